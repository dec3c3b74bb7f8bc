// src/train/data.cc — corpus loading, split and batch sampling (see data.h).
#include "train/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>

namespace tiermem::train {
namespace fs = std::filesystem;

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw DataError(fmt::format("--data {}: {}", path, what));
}

// Reads the whole file; throws DataError naming it.
std::string read_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, errno_message("cannot open", errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail(path, errno_message("cannot stat", e));
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    fail(path, "is a directory");
  }
  std::string data;
  data.resize(static_cast<std::size_t>(st.st_size));
  std::size_t done = 0;
  while (true) {
    if (done == data.size()) data.resize(std::max<std::size_t>(4096, data.size() * 2));
    ssize_t n = ::read(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      fail(path, errno_message(fmt::format("read failed at offset {}", done), e));
    }
    if (n == 0) break;
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  data.resize(done);
  return data;
}

bool looks_binary(const std::string& bytes) {
  std::size_t n = std::min<std::size_t>(bytes.size(), 8192);
  return std::memchr(bytes.data(), 0, n) != nullptr;
}

bool skipped_name(const fs::path& p) {
  std::string name = p.filename().string();
  if (name.empty() || name[0] == '.') return true;
  std::string ext = p.extension().string();
  return ext == ".dat" || ext == ".u8";
}

void check_vocab(const Corpus& c, int vocab_size) {
  for (std::size_t i = 0; i < c.tokens.size(); ++i) {
    if (c.tokens[i] >= vocab_size) {
      fail(c.path, fmt::format("token {} (index {} of {}) is >= the model's vocabulary size {}",
                               c.tokens[i], i, c.tokens.size(), vocab_size));
    }
  }
}

void load_token_file(const std::string& path, Corpus* c, int vocab_size) {
  std::string bytes = read_file(path);
  if (bytes.empty()) fail(path, "token file is empty");
  std::size_t header = 0;
  std::uint64_t expect_tokens = 0;
  std::uint32_t magic = 0;
  if (bytes.size() >= 1024) std::memcpy(&magic, bytes.data(), 4);
  if (magic == kLlmcMagic) {
    std::int32_t h[3];
    std::memcpy(h, bytes.data(), sizeof h);
    if (h[1] != 1) fail(path, fmt::format("llm.c token file version {} (expected 1)", h[1]));
    if (h[2] < 0) fail(path, fmt::format("llm.c header: negative token count {}", h[2]));
    header = 1024;
    expect_tokens = static_cast<std::uint64_t>(h[2]);
    if (bytes.size() != header + 2 * expect_tokens) {
      fail(path, fmt::format("llm.c header says {} tokens ({} bytes with the 1024-byte header) "
                             "but the file has {} bytes",
                             expect_tokens, header + 2 * expect_tokens, bytes.size()));
    }
    c->format = CorpusFormat::kLlmcTokens;
  } else {
    if (bytes.size() % 2 != 0) {
      fail(path, fmt::format("token file size {} bytes is not a multiple of 2 (uint16 tokens)",
                             bytes.size()));
    }
    c->format = CorpusFormat::kNanoGptTokens;
  }
  std::size_t n = (bytes.size() - header) / 2;
  if (n == 0) fail(path, "token file holds no tokens");
  c->tokens.resize(n);
  std::memcpy(c->tokens.data(), bytes.data() + header, n * 2);  // little-endian host
  c->byte_level = false;
  c->files.push_back(path);
  check_vocab(*c, vocab_size);
}

}  // namespace

const char* corpus_format_name(CorpusFormat f) {
  switch (f) {
    case CorpusFormat::kText: return "text";
    case CorpusFormat::kTextDir: return "text directory";
    case CorpusFormat::kLlmcTokens: return "llm.c uint16 tokens";
    case CorpusFormat::kNanoGptTokens: return "nanoGPT uint16 tokens";
  }
  return "?";
}

Corpus load_corpus(const std::string& path, int vocab_size) {
  Corpus c;
  c.path = path;
  std::error_code ec;
  fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) {
    fail(path, ec && ec != std::errc::no_such_file_or_directory
                   ? "cannot access: " + ec.message()
                   : std::string("no such file or directory"));
  }
  if (fs::is_directory(st)) {
    c.format = CorpusFormat::kTextDir;
    std::vector<fs::path> files;
    fs::recursive_directory_iterator it(path, fs::directory_options::none, ec), end;
    if (ec) fail(path, "cannot list directory: " + ec.message());
    for (; it != end; it.increment(ec)) {
      if (ec) fail(path, "cannot list directory: " + ec.message());
      const fs::path& p = it->path();
      if (skipped_name(p)) {
        if (it->is_directory(ec)) it.disable_recursion_pending();
        continue;
      }
      if (it->is_regular_file(ec)) files.push_back(p);
    }
    std::sort(files.begin(), files.end(), [&](const fs::path& a, const fs::path& b) {
      return a.lexically_relative(path).string() < b.lexically_relative(path).string();
    });
    std::string all;
    for (const fs::path& f : files) {
      std::string text = read_file(f.string());
      if (text.empty() || looks_binary(text)) continue;
      all += text;
      c.files.push_back(f.string());
    }
    if (c.files.empty()) fail(path, "directory holds no non-empty text files");
    if (vocab_size < kByteVocab) {
      fail(path, fmt::format("text is byte-level (vocabulary 256) but the model's vocabulary is "
                             "{}", vocab_size));
    }
    c.tokens.assign(all.begin(), all.end());
    for (std::size_t i = 0; i < all.size(); ++i) c.tokens[i] = static_cast<unsigned char>(all[i]);
  } else if (!fs::is_regular_file(st)) {  // a FIFO or device would block or never end
    fail(path, "is not a regular file or a directory");
  } else if (fs::path(path).extension() == ".bin") {
    load_token_file(path, &c, vocab_size);
  } else {
    c.format = CorpusFormat::kText;
    std::string text = read_file(path);
    if (text.empty()) fail(path, "file is empty");
    if (looks_binary(text)) {  // the same test that skips binary files in a directory
      fail(path, "does not look like text (binary bytes); give a text file, a directory of text "
                 "files, or uint16 tokens in a .bin file");
    }
    if (vocab_size < kByteVocab) {
      fail(path, fmt::format("text is byte-level (vocabulary 256) but the model's vocabulary is "
                             "{}", vocab_size));
    }
    c.tokens.resize(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) c.tokens[i] = static_cast<unsigned char>(text[i]);
    c.files.push_back(path);
  }
  for (std::uint16_t t : c.tokens) c.max_token = std::max(c.max_token, t);
  return c;
}

Split split_corpus(const Corpus& corpus, int seq_len, double eval_fraction) {
  const std::uint64_t n = corpus.tokens.size();
  const std::uint64_t need = static_cast<std::uint64_t>(seq_len) + 1;
  std::uint64_t eval = static_cast<std::uint64_t>(static_cast<double>(n) * eval_fraction);
  eval = std::max(eval, need);
  if (n < eval + need) {
    fail(corpus.path, fmt::format("{} tokens are too few for --seq-len {}: need at least {} "
                                  "(seq-len + 1 each for training and the held-out eval split)",
                                  n, seq_len, 2 * need));
  }
  Split s;
  s.train = corpus.tokens.data();
  s.train_tokens = n - eval;
  s.eval = corpus.tokens.data() + (n - eval);
  s.eval_tokens = eval;
  return s;
}

std::uint64_t mix64(std::uint64_t seed, std::uint64_t k) {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * (k + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

BatchSampler::BatchSampler(const std::uint16_t* tokens, std::uint64_t num_tokens, int seq_len,
                           std::uint64_t seed)
    : tokens_(tokens), num_tokens_(num_tokens), seq_len_(seq_len), seed_(seed) {
  if (num_tokens_ < static_cast<std::uint64_t>(seq_len_) + 1) {
    throw DataError(fmt::format("BatchSampler: {} tokens are fewer than seq_len + 1 = {}",
                                num_tokens_, seq_len_ + 1));
  }
}

std::uint64_t BatchSampler::offset_of(std::uint64_t k) const {
  const std::uint64_t windows = num_tokens_ - static_cast<std::uint64_t>(seq_len_);
  return mix64(seed_, k) % windows;
}

void BatchSampler::fill(std::uint64_t first, int rows, Batch* out) const {
  out->batch = rows;
  out->seq_len = seq_len_;
  const std::size_t t = static_cast<std::size_t>(seq_len_);
  out->inputs.resize(static_cast<std::size_t>(rows) * t);
  out->targets.resize(static_cast<std::size_t>(rows) * t);
  for (int r = 0; r < rows; ++r) {
    const std::uint16_t* src = tokens_ + offset_of(first + static_cast<std::uint64_t>(r));
    std::int32_t* in = out->inputs.data() + static_cast<std::size_t>(r) * t;
    std::int32_t* tg = out->targets.data() + static_cast<std::size_t>(r) * t;
    for (std::size_t i = 0; i < t; ++i) {
      in[i] = src[i];
      tg[i] = src[i + 1];
    }
  }
}

void BatchSampler::next_batch(int global_rows, int row_begin, int rows, Batch* out) {
  fill(position_ + static_cast<std::uint64_t>(row_begin), rows, out);
  position_ += static_cast<std::uint64_t>(global_rows);
}

}  // namespace tiermem::train
