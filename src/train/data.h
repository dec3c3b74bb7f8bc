// src/train/data.h — training data for tiermem-train: loading a corpus into tokens, the
// train/eval split, and a deterministic batch sampler whose position can be saved and restored.
//
// What `--data PATH` may be (detected in this order):
//   1. a directory: every regular file under it, recursively, in sorted path order (byte-wise
//      comparison of the relative path, so the order is the same on every machine), read as
//      text. Files named *.dat or *.u8 (the strfile indexes and links of Debian's `fortunes`
//      package) and binary files (a NUL byte in their first 8 KiB) are skipped; hidden entries
//      (names starting with '.') too. Files are joined with no separator.
//   2. a file whose name ends in `.bin`: uint16 little-endian token ids.
//        - llm.c format: a 256 × int32 header whose first word is the magic 20240520, second the
//          version (1), third the number of tokens N; then N uint16 tokens. The file size must
//          be exactly 1024 + 2·N bytes.
//        - nanoGPT format (no header): the whole file is uint16 tokens; its size must be even.
//      A .bin file of at least 1024 bytes whose first int32 is 20240520 is read as llm.c, any
//      other .bin as nanoGPT.
//   3. any other file: text.
// Text becomes byte-level tokens (vocabulary 256: token = byte value).
// With no `--data`, the default corpus is /usr/share/games/fortunes (Debian's `fortunes`
// package, ~2.5 MB of text in 40-odd files).
//
// Errors (all DataError, a tiermem::Error, whose message names the file): missing path,
// unreadable file or directory, empty file or corpus, a directory with no text files, a token
// file whose size is odd or does not match its header, a token id >= the vocabulary (naming the
// token's index and value), a corpus too small for the sequence length.
//
// Thread-safety: load_corpus is reentrant. A BatchSampler is a small value; const methods are
// thread-safe, next_batch is not.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tiermem/error.h"

namespace tiermem::train {

// A problem with --data. what() is one line that starts with the offending path.
class DataError : public Error {
 public:
  explicit DataError(const std::string& message) : Error(message) {}
};

inline constexpr const char* kDefaultCorpus = "/usr/share/games/fortunes";
inline constexpr int kByteVocab = 256;
inline constexpr std::uint32_t kLlmcMagic = 20240520;

enum class CorpusFormat { kText, kTextDir, kLlmcTokens, kNanoGptTokens };
const char* corpus_format_name(CorpusFormat f);

struct Corpus {
  std::string path;                 // as given
  CorpusFormat format = CorpusFormat::kText;
  std::vector<std::string> files;   // the files read, in order
  std::vector<std::uint16_t> tokens;
  bool byte_level = true;           // text: vocabulary 256
  std::uint16_t max_token = 0;
};

// Reads `path` as described at the top of this file. `vocab_size` is the model's vocabulary:
// every token id must be < vocab_size (for text, vocab_size must be >= 256). Throws DataError.
Corpus load_corpus(const std::string& path, int vocab_size);

// Train / held-out split of a token stream: the last `eval_fraction` of the tokens (at least
// min_tokens) are held out for the eval loss; the rest is trained on. Spans into the corpus.
struct Split {
  const std::uint16_t* train = nullptr;
  std::uint64_t train_tokens = 0;
  const std::uint16_t* eval = nullptr;
  std::uint64_t eval_tokens = 0;
};

// Throws DataError (naming `corpus.path`) when either part would have fewer than seq_len + 1
// tokens.
Split split_corpus(const Corpus& corpus, int seq_len, double eval_fraction = 0.1);

// One micro-batch: `batch` rows of `seq_len` input tokens and the next-token targets, row-major
// [batch][seq_len], int32 as the model takes them.
struct Batch {
  int batch = 0, seq_len = 0;
  std::vector<std::int32_t> inputs;
  std::vector<std::int32_t> targets;
};

// Picks training windows. Sequence number k (0, 1, 2, ... over the whole run) starts at
// offset splitmix64(seed, k) mod (tokens - seq_len), so the sample depends only on (seed, k):
// the sampler's whole state is `position` (the next k). A global batch of G sequences split
// over R ranks gives rank r the sequences [r·G/R, (r+1)·G/R) of each global batch, so a 1-rank
// run with batch G and an R-rank run with batch G/R see exactly the same data.
class BatchSampler {
 public:
  BatchSampler(const std::uint16_t* tokens, std::uint64_t num_tokens, int seq_len,
               std::uint64_t seed);

  // Fills `out` with rows [row_begin, row_begin + rows) of the next global batch of
  // `global_rows` sequences, then advances position by global_rows.
  void next_batch(int global_rows, int row_begin, int rows, Batch* out);
  // The same without advancing: sequence numbers [first, first + rows).
  void fill(std::uint64_t first, int rows, Batch* out) const;
  // Start offset of sequence k.
  std::uint64_t offset_of(std::uint64_t k) const;

  std::uint64_t position() const { return position_; }
  void set_position(std::uint64_t p) { position_ = p; }
  std::uint64_t seed() const { return seed_; }

 private:
  const std::uint16_t* tokens_;
  std::uint64_t num_tokens_;
  int seq_len_;
  std::uint64_t seed_;
  std::uint64_t position_ = 0;
};

// splitmix64 of (seed, k): a counter-based 64-bit mix (Steele, Lea, Flood, "Fast splittable
// pseudorandom number generators", OOPSLA 2014).
std::uint64_t mix64(std::uint64_t seed, std::uint64_t k);

}  // namespace tiermem::train
