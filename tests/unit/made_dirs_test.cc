// src/nvme/made_dirs.h: what tiermem makes for its swap spaces goes when the last user leaves;
// what the user made stays; two "ranks" sharing a path leave nothing behind whichever closes first;
// a SwapSpace made over such directories removes them in its destructor.
#include "nvme/made_dirs.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "tiermem/error.h"

namespace tiermem::detail {
namespace {

namespace fs = std::filesystem;

fs::path scratch() {
  fs::path d = fs::temp_directory_path() / ("tiermem-made-dirs-" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

TEST(MadeDirs, MissingLevelsAreMarkedAndRemovedWhenDone) {
  const fs::path top = scratch();  // made by "the user": stays
  const fs::path base = top / "a" / "p";
  auto dirs = make_marked_dirs(base.string(), "rank0");
  ASSERT_EQ(dirs.size(), 3u);  // rank0, p, a: innermost first
  EXPECT_EQ(dirs[0], (base / "rank0").string());
  EXPECT_EQ(dirs[1], base.string());
  EXPECT_EQ(dirs[2], (top / "a").string());
  EXPECT_TRUE(fs::exists(base / kMadeMarker));
  EXPECT_FALSE(fs::exists(top / kMadeMarker));
  struct stat st {};
  ASSERT_EQ(::stat(base.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  for (const auto& d : dirs) remove_if_unused(d);
  EXPECT_FALSE(fs::exists(top / "a"));
  EXPECT_TRUE(fs::exists(top));
  fs::remove_all(top);
}

// A killed run leaves its rank directory (and the marked base) behind; the next run, which finds
// them, removes both when it is done. In a directory the user made, a found rank directory stays.
TEST(MadeDirs, AKilledRunsRankDirectoryGoesWithTheNextRun) {
  const fs::path top = scratch();
  const fs::path base = top / "swap";
  make_marked_dirs(base.string(), "rank0");  // the killed run: never removed
  auto dirs = make_marked_dirs(base.string(), "rank0");
  ASSERT_EQ(dirs.size(), 2u);
  EXPECT_EQ(dirs[0], (base / "rank0").string());
  for (const auto& d : dirs) remove_if_unused(d);
  EXPECT_FALSE(fs::exists(base));
  fs::create_directories(top / "rank0");  // the user's own path, with a rank directory in it
  EXPECT_TRUE(make_marked_dirs(top.string(), "rank0").empty());
  fs::remove_all(top);
}

TEST(MadeDirs, AUserDirectoryStaysEvenWhenEmpty) {
  const fs::path top = scratch();
  auto dirs = make_marked_dirs(top.string(), "rank0");
  ASSERT_EQ(dirs.size(), 1u);  // only the rank directory: top was there before
  for (const auto& d : dirs) remove_if_unused(d);
  EXPECT_TRUE(fs::exists(top));
  EXPECT_TRUE(fs::is_empty(top));
  fs::remove_all(top);
}

TEST(MadeDirs, SharedPathGoesWithTheLastRankWhicheverClosesFirst) {
  for (int first : {0, 1}) {
    const fs::path top = scratch();
    const fs::path base = top / "swap";
    auto r0 = make_marked_dirs(base.string(), "rank0");  // made the base
    auto r1 = make_marked_dirs(base.string(), "rank1");  // found it, marked
    ASSERT_EQ(r1.size(), 2u);
    EXPECT_EQ(r1[1], base.string());
    auto& a = first == 0 ? r0 : r1;
    auto& b = first == 0 ? r1 : r0;
    for (const auto& d : a) remove_if_unused(d);
    EXPECT_TRUE(fs::exists(base / kMadeMarker)) << "the other rank still uses it";
    for (const auto& d : b) remove_if_unused(d);
    EXPECT_FALSE(fs::exists(base)) << "first " << first;
    fs::remove_all(top);
  }
}

TEST(MadeDirs, ADirectoryWithOtherFilesStays) {
  const fs::path top = scratch();
  const fs::path base = top / "swap";
  auto dirs = make_marked_dirs(base.string(), "");
  ASSERT_EQ(dirs.size(), 1u);
  { FILE* f = std::fopen((base / "user.txt").c_str(), "w"); ASSERT_NE(f, nullptr); std::fclose(f); }
  remove_if_unused(base.string());
  EXPECT_TRUE(fs::exists(base / "user.txt"));
  EXPECT_TRUE(fs::exists(base / kMadeMarker));  // still tiermem's: removed once the file goes
  fs::remove(base / "user.txt");
  remove_if_unused(base.string());
  EXPECT_FALSE(fs::exists(base));
  fs::remove_all(top);
}

TEST(MadeDirs, ALevelThatCannotBeMadeIsAnIoError) {
  const fs::path top = scratch();
  { FILE* f = std::fopen((top / "file").c_str(), "w"); ASSERT_NE(f, nullptr); std::fclose(f); }
  EXPECT_THROW(make_marked_dirs((top / "file" / "swap").string(), "rank0"), IoError);
  fs::remove_all(top);
}

}  // namespace
}  // namespace tiermem::detail
