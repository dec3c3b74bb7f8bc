// Tests of tiermem-train's checkpoint files (include/tiermem/checkpoint.h): round trip, and clear
// errors for corrupt, truncated and partial checkpoints.
#include "tiermem/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace tiermem::train {
namespace {
namespace fs = std::filesystem;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tiermem_train_ckpt_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    a_.resize(1000);
    b_.resize(37);
    for (std::size_t i = 0; i < a_.size(); ++i) a_[i] = 0.5f * static_cast<float>(i);
    for (std::size_t i = 0; i < b_.size(); ++i) b_[i] = -1.0f * static_cast<float>(i);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void save(int step) {
    CheckpointWriter w(dir_.string(), 0, 1, step);
    w.add_tensor("a", Tier::kNvme, a_.data(), a_.size() * 4, "f32", {1000});
    w.add_tensor("b", Tier::kHost, b_.data(), b_.size() * 4, "f32", {37});
    w.commit({{"hello", step}});
  }
  std::string error_of_load() {
    try {
      CheckpointReader r(dir_.string(), 0);
      std::vector<float> a(1000), b(37);
      r.read_tensor("a", a.data(), a.size() * 4);
      r.read_tensor("b", b.data(), b.size() * 4);
    } catch (const CheckpointError& e) {
      return e.what();
    }
    return "";
  }
  fs::path rank_dir() const { return dir_ / "rank0"; }
  std::string manifest_text() const {
    std::ifstream in(rank_dir() / "manifest.json");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  void write_manifest(const std::string& s) const {
    std::ofstream(rank_dir() / "manifest.json", std::ios::trunc) << s;
  }

  fs::path dir_;
  std::vector<float> a_, b_;
};

TEST_F(CheckpointTest, RoundTripAndOldStateRemoved) {
  save(5);
  save(10);
  EXPECT_FALSE(fs::exists(rank_dir() / "state-00000005.bin"));
  EXPECT_TRUE(fs::exists(rank_dir() / "state-00000010.bin"));
  EXPECT_FALSE(fs::exists(rank_dir() / "manifest.json.tmp"));
  CheckpointReader r(dir_.string(), 0);
  EXPECT_EQ(r.step(), 10);
  EXPECT_EQ(r.meta().at("hello"), 10);
  ASSERT_EQ(r.tensors().size(), 2u);
  EXPECT_EQ(r.tensors()[0].tier, Tier::kNvme);
  EXPECT_EQ(r.tensors()[1].offset % 4096, 0u);
  std::vector<float> a(1000), b(37);
  r.read_tensor("a", a.data(), a.size() * 4);
  r.read_tensor("b", b.data(), b.size() * 4);
  EXPECT_EQ(a, a_);
  EXPECT_EQ(b, b_);
  EXPECT_EQ(error_of_load(), "");
}

// Streamed tensors: written in interleaved parts, read back whole or in parts with the same
// checksum an add_tensor of the same bytes gets; verify_tensor catches a flipped byte; parts past
// the end, an incomplete tensor at commit and reads outside a tensor are CheckpointErrors.
TEST_F(CheckpointTest, StreamedTensorsInInterleavedParts) {
  {
    CheckpointWriter w(dir_.string(), 0, 1, 4);
    const int ha = w.begin_tensor("a", Tier::kNvme, a_.size() * 4, "f32", {1000});
    const int hb = w.begin_tensor("b", Tier::kHost, b_.size() * 4, "f32", {37});
    w.write_part(ha, a_.data(), 400 * 4);
    w.write_part(hb, b_.data(), 10 * 4);
    w.write_part(ha, a_.data() + 400, 600 * 4);
    EXPECT_THROW(w.write_part(hb, b_.data(), 28 * 4), CheckpointError) << "one element too many";
    w.write_part(hb, b_.data() + 10, 27 * 4);
    w.commit({{"hello", 4}});
  }
  EXPECT_EQ(error_of_load(), "");  // whole-tensor reads verify the streamed checksums
  CheckpointReader r(dir_.string(), 0);
  EXPECT_EQ(r.tensors()[0].xxh64, checksum64(a_.data(), a_.size() * 4));
  r.verify_tensor("a", a_.size() * 4);
  std::vector<float> part(100);
  r.read_part("a", 900 * 4, part.data(), 100 * 4);
  EXPECT_EQ(part, std::vector<float>(a_.begin() + 900, a_.end()));
  EXPECT_THROW(r.read_part("a", 950 * 4, part.data(), 100 * 4), CheckpointError);
  EXPECT_THROW(r.verify_tensor("a", 999 * 4), CheckpointError);
  {
    std::fstream f(rank_dir() / "state-00000004.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(3000);
    f.put('\x7f');
  }
  CheckpointReader r2(dir_.string(), 0);
  try {
    r2.verify_tensor("a", a_.size() * 4);
    ADD_FAILURE() << "a flipped byte passed verify_tensor";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
  }
  // An incomplete streamed tensor is refused at commit; the previous checkpoint stays.
  {
    CheckpointWriter w(dir_.string(), 0, 1, 8);
    const int ha = w.begin_tensor("a", Tier::kNvme, a_.size() * 4, "f32", {1000});
    w.write_part(ha, a_.data(), 4);
    EXPECT_THROW(w.commit({{"hello", 8}}), CheckpointError);
  }
  EXPECT_EQ(CheckpointReader(dir_.string(), 0).step(), 4);
}

TEST_F(CheckpointTest, FlippedByteIsAChecksumMismatchNamingTheTensor) {
  save(3);
  const fs::path state = rank_dir() / "state-00000003.bin";
  {
    std::fstream f(state, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  const std::string e = error_of_load();
  EXPECT_NE(e.find("tensor 'a'"), std::string::npos) << e;
  EXPECT_NE(e.find("checksum mismatch"), std::string::npos) << e;
  EXPECT_NE(e.find(state.string()), std::string::npos) << e;
}

TEST_F(CheckpointTest, TruncatedStateFileSaysExpectedAndFoundBytes) {
  save(3);
  const fs::path state = rank_dir() / "state-00000003.bin";
  fs::resize_file(state, 2000);
  const std::string e = error_of_load();
  EXPECT_NE(e.find("size mismatch"), std::string::npos) << e;
  EXPECT_NE(e.find("the file has 2000"), std::string::npos) << e;
}

TEST_F(CheckpointTest, MissingManifestOrKeyOrBadJson) {
  save(3);
  const std::string good = manifest_text();
  fs::remove(rank_dir() / "manifest.json");
  EXPECT_NE(error_of_load().find("missing manifest.json"), std::string::npos);

  std::string no_step = good;
  const auto pos = no_step.find("\"step\"");
  ASSERT_NE(pos, std::string::npos);
  no_step.replace(pos, 6, "\"stop\"");
  write_manifest(no_step);
  EXPECT_NE(error_of_load().find("missing key 'step'"), std::string::npos) << error_of_load();

  write_manifest(good.substr(0, good.size() / 2));
  EXPECT_NE(error_of_load().find("not valid JSON"), std::string::npos) << error_of_load();

  fs::remove_all(dir_);
  EXPECT_NE(error_of_load().find("no such directory"), std::string::npos) << error_of_load();
}

TEST_F(CheckpointTest, WrongSizeAndUnknownTensor) {
  save(3);
  CheckpointReader r(dir_.string(), 0);
  std::vector<float> x(10);
  EXPECT_THROW(r.read_tensor("a", x.data(), 40), CheckpointError);
  EXPECT_THROW(r.read_tensor("zzz", x.data(), 40), CheckpointError);
}

// Symlinks planted at the checkpoint's temporary names (a shared directory) are never followed:
// the writer fails with ELOOP naming the path, and the files they point to keep their contents.
TEST_F(CheckpointTest, SymlinksPlantedAtTemporaryNamesAreNotFollowed) {
  const fs::path victim = dir_ / "victim.txt";
  fs::create_directories(rank_dir());
  std::ofstream(victim) << "precious\n";
  fs::create_symlink(victim, rank_dir() / "state-00000005.bin.tmp");
  try {
    CheckpointWriter w(dir_.string(), 0, 1, 5);
    FAIL() << "the state file's temporary name was opened through a symlink";
  } catch (const IoError& e) {
    EXPECT_EQ(e.err(), ELOOP) << e.what();
    EXPECT_EQ(e.path(), (rank_dir() / "state-00000005.bin.tmp").string());
    EXPECT_NE(std::string(e.what()).find("symbolic link"), std::string::npos) << e.what();
  }
  fs::remove(rank_dir() / "state-00000005.bin.tmp");
  fs::create_symlink(victim, rank_dir() / "manifest.json.tmp");
  {
    CheckpointWriter w(dir_.string(), 0, 1, 6);
    w.add_tensor("a", Tier::kNvme, a_.data(), a_.size() * 4, "f32", {1000});
    try {
      w.commit({});
      FAIL() << "the manifest's temporary name was opened through a symlink";
    } catch (const IoError& e) {
      EXPECT_EQ(e.err(), ELOOP) << e.what();
      EXPECT_EQ(e.path(), (rank_dir() / "manifest.json.tmp").string());
    }
  }
  std::ifstream in(victim);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(ss.str(), "precious\n");
}

// Checkpoint files keep the user's umask (0666 less it), as torch.save's do.
TEST_F(CheckpointTest, FilesKeepTheUmask) {
  const mode_t old = ::umask(027);
  save(3);
  ::umask(old);
  for (const auto& e : fs::directory_iterator(rank_dir())) {
    EXPECT_EQ(e.status().permissions() & fs::perms::mask,
              fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read)
        << e.path();
  }
}

}  // namespace
}  // namespace tiermem::train
