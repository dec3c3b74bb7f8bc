// Tests of tiermem-train's data loading (src/train/data.h): formats, detection, errors that
// name the file, the split, and the deterministic, resumable batch sampler.
#include "train/data.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace tiermem::train {
namespace {
namespace fs = std::filesystem;

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tiermem_train_data_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& bytes) {
    fs::path p = dir_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << bytes;
    return p.string();
  }
  static std::string u16(const std::vector<std::uint16_t>& v) {
    std::string s(v.size() * 2, '\0');
    std::memcpy(s.data(), v.data(), s.size());
    return s;
  }
  static std::string llmc(const std::vector<std::uint16_t>& v, std::int32_t count_override = -1) {
    std::vector<std::int32_t> h(256, 0);
    h[0] = static_cast<std::int32_t>(kLlmcMagic);
    h[1] = 1;
    h[2] = count_override >= 0 ? count_override : static_cast<std::int32_t>(v.size());
    std::string s(1024, '\0');
    std::memcpy(s.data(), h.data(), 1024);
    return s + u16(v);
  }
  // The DataError message of load_corpus(path), or "" when it did not throw.
  static std::string error_of(const std::string& path, int vocab = 256) {
    try {
      load_corpus(path, vocab);
    } catch (const DataError& e) {
      return e.what();
    }
    return "";
  }
  fs::path dir_;
};

TEST_F(DataTest, TextFileIsByteTokens) {
  std::string p = write("a.txt", "hi\xff");
  Corpus c = load_corpus(p, 256);
  EXPECT_EQ(c.format, CorpusFormat::kText);
  ASSERT_EQ(c.tokens.size(), 3u);
  EXPECT_EQ(c.tokens[0], 'h');
  EXPECT_EQ(c.tokens[2], 255);
  EXPECT_TRUE(c.byte_level);
}

TEST_F(DataTest, DirectoryIsRecursiveSortedAndSkipsIndexesAndBinaries) {
  write("b", "BB");
  write("a/z", "ZZ");
  write("a/y", "YY");
  write("c.dat", "index");
  write("c.u8", "link");
  write("bin", std::string("x\0y", 3));
  write(".hidden", "HH");
  write("empty", "");
  Corpus c = load_corpus(dir_.string(), 256);
  EXPECT_EQ(c.format, CorpusFormat::kTextDir);
  std::string text(c.tokens.begin(), c.tokens.end());
  EXPECT_EQ(text, "YYZZBB");  // a/y, a/z, b
  ASSERT_EQ(c.files.size(), 3u);
  EXPECT_EQ(fs::path(c.files[0]).filename(), "y");
}

TEST_F(DataTest, NanoGptHeaderlessTokens) {
  std::string p = write("t.bin", u16({1, 2, 300, 4}));
  Corpus c = load_corpus(p, 50257);
  EXPECT_EQ(c.format, CorpusFormat::kNanoGptTokens);
  EXPECT_EQ(c.tokens, (std::vector<std::uint16_t>{1, 2, 300, 4}));
  EXPECT_FALSE(c.byte_level);
}

TEST_F(DataTest, LlmcHeaderedTokens) {
  std::vector<std::uint16_t> v(700);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::uint16_t>(i % 50000);
  std::string p = write("t.bin", llmc(v));
  Corpus c = load_corpus(p, 50257);
  EXPECT_EQ(c.format, CorpusFormat::kLlmcTokens);
  EXPECT_EQ(c.tokens, v);
}

TEST_F(DataTest, ErrorsNameTheFile) {
  const std::string missing = (dir_ / "nope.txt").string();
  std::string e = error_of(missing);
  EXPECT_NE(e.find(missing), std::string::npos) << e;
  EXPECT_NE(e.find("no such file"), std::string::npos) << e;

  const std::string empty = write("empty.txt", "");
  e = error_of(empty);
  EXPECT_NE(e.find(empty), std::string::npos) << e;
  EXPECT_NE(e.find("empty"), std::string::npos) << e;

  const std::string odd = write("odd.bin", "abc");
  e = error_of(odd, 50257);
  EXPECT_NE(e.find(odd), std::string::npos) << e;
  EXPECT_NE(e.find("not a multiple of 2"), std::string::npos) << e;

  const std::string big = write("big.bin", u16({1, 2, 256, 3}));
  e = error_of(big, 256);
  EXPECT_NE(e.find(big), std::string::npos) << e;
  EXPECT_NE(e.find("token 256 (index 2"), std::string::npos) << e;

  const std::string truncated = write("trunc.bin", llmc(std::vector<std::uint16_t>(600, 1), 900));
  e = error_of(truncated, 256);
  EXPECT_NE(e.find(truncated), std::string::npos) << e;
  EXPECT_NE(e.find("header says 900 tokens"), std::string::npos) << e;

  fs::create_directories(dir_ / "only_index");
  write("only_index/x.dat", "idx");
  e = error_of((dir_ / "only_index").string());
  EXPECT_NE(e.find("no non-empty text files"), std::string::npos) << e;

  const std::string binary = write("garbage.dat", std::string("ab\0\xff\x01" "cd", 7));
  e = error_of(binary);
  EXPECT_NE(e.find(binary), std::string::npos) << e;
  EXPECT_NE(e.find("does not look like text"), std::string::npos) << e;

  const std::string text = write("small.txt", "abc");
  e = error_of(text, 64);
  EXPECT_NE(e.find("vocabulary"), std::string::npos) << e;
}

TEST_F(DataTest, SplitHoldsOutTheTailAndRejectsTinyCorpora) {
  Corpus c;
  c.path = "mem";
  c.tokens.resize(1000);
  Split s = split_corpus(c, 16, 0.1);
  EXPECT_EQ(s.train_tokens, 900u);
  EXPECT_EQ(s.eval_tokens, 100u);
  EXPECT_EQ(s.eval, c.tokens.data() + 900);
  c.tokens.resize(30);
  EXPECT_THROW(split_corpus(c, 16, 0.1), DataError);
}

TEST_F(DataTest, SamplerIsDeterministicAndResumable) {
  std::vector<std::uint16_t> toks(5000);
  for (std::size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<std::uint16_t>(i % 251);
  BatchSampler a(toks.data(), toks.size(), 8, 42), b(toks.data(), toks.size(), 8, 42);
  Batch x, y;
  for (int i = 0; i < 5; ++i) a.next_batch(4, 0, 4, &x);
  // b jumps straight to a's position: same next batch.
  b.set_position(a.position());
  a.next_batch(4, 0, 4, &x);
  b.next_batch(4, 0, 4, &y);
  EXPECT_EQ(x.inputs, y.inputs);
  EXPECT_EQ(x.targets, y.targets);
  EXPECT_EQ(a.position(), 24u);
  // Targets are inputs shifted by one, inside the corpus.
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t + 1 < 8; ++t) EXPECT_EQ(x.targets[r * 8 + t], x.inputs[r * 8 + t + 1]);
  // Another seed gives other windows.
  BatchSampler c(toks.data(), toks.size(), 8, 43);
  c.set_position(20);
  c.next_batch(4, 0, 4, &y);
  EXPECT_NE(x.inputs, y.inputs);
}

TEST_F(DataTest, RanksSplitTheGlobalBatchExactly) {
  std::vector<std::uint16_t> toks(5000);
  for (std::size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<std::uint16_t>(i * 7 % 256);
  BatchSampler one(toks.data(), toks.size(), 8, 7), r0(toks.data(), toks.size(), 8, 7),
      r1(toks.data(), toks.size(), 8, 7);
  Batch g, a, b;
  for (int step = 0; step < 3; ++step) {
    one.next_batch(4, 0, 4, &g);
    r0.next_batch(4, 0, 2, &a);
    r1.next_batch(4, 2, 2, &b);
    std::vector<std::int32_t> joined = a.inputs;
    joined.insert(joined.end(), b.inputs.begin(), b.inputs.end());
    EXPECT_EQ(joined, g.inputs) << "step " << step;
  }
}

TEST(DataDefaultCorpus, FortunesLoadsWhenInstalled) {
  if (!fs::exists(kDefaultCorpus)) GTEST_SKIP() << "fortunes not installed (scripts/setup.sh)";
  Corpus c = load_corpus(kDefaultCorpus, 256);
  EXPECT_GT(c.tokens.size(), 1'000'000u);
  for (const std::string& f : c.files) {
    EXPECT_NE(fs::path(f).extension(), ".dat") << f;
    EXPECT_NE(fs::path(f).extension(), ".u8") << f;
  }
}

}  // namespace
}  // namespace tiermem::train
