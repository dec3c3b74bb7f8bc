// parse_manifest (include/tiermem/checkpoint.h) against bad manifests: every input is either a valid
// manifest or a CheckpointError that names the file and the key. Cases found by
// tests/fuzz/manifest_fuzz.cc are kept here (and in tests/fuzz/corpus/manifest/crash-*).
#include <gtest/gtest.h>

#include <string>

#include "tiermem/checkpoint.h"

namespace {
using tiermem::CheckpointError;
using tiermem::parse_manifest;

const char* kGood = R"({"format":"tiermem-train-checkpoint","version":1,"rank":0,"world_size":1,
 "step":4,"state_file":"state-00000004.bin","state_bytes":8192,"meta":{"seed":7},
 "tensors":[{"name":"embed.param","dtype":"f32","shape":[2,3],"bytes":24,"tier":"nvme",
   "file":"state-00000004.bin","offset":0,"xxh64":"00000000deadbeef"},
  {"name":"embed.adam_m","dtype":"f32","shape":[6],"bytes":24,"tier":"host",
   "file":"state-00000004.bin","offset":4096,"xxh64":"1"}]})";

// The error for `text`, or "" when it parsed.
std::string error_of(const std::string& text) {
  try {
    parse_manifest(text, "ck/rank0/manifest.json");
    return "";
  } catch (const CheckpointError& e) {
    return e.what();
  }
}

std::string with(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return text.replace(at, from.size(), to);
}

TEST(ParseManifest, GoodManifest) {
  const auto m = parse_manifest(kGood, "m.json");
  EXPECT_EQ(m.step, 4);
  EXPECT_EQ(m.state_bytes, 8192u);
  ASSERT_EQ(m.tensors.size(), 2u);
  EXPECT_EQ(m.tensors[0].xxh64, 0xdeadbeefu);
  EXPECT_EQ(m.tensors[1].offset, 4096u);
  EXPECT_EQ(m.tensors[0].shape, (std::vector<std::int64_t>{2, 3}));
}

// Found by manifest_fuzz: a number literal that overflows a double made nlohmann throw
// out_of_range (not parse_error), which escaped the reader as an unnamed std::exception.
TEST(ParseManifest, FuzzFoundNumberOverflowIsACheckpointError) {
  const std::string e = error_of(with(kGood, "\"bytes\":24", "\"bytes\":184e3372036854777807"));
  EXPECT_NE(e.find("ck/rank0/manifest.json"), std::string::npos) << e;
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
}

TEST(ParseManifest, EveryBadKeyIsNamed) {
  struct Case {
    std::string from, to, expect;
  } cases[] = {
      {"\"version\":1", "\"version\":2", "key 'version'"},
      {"\"rank\":0", "\"rank\":1", "key 'rank'"},
      {"\"rank\":0", "\"rank\":\"0\"", "key 'rank' must be an integer"},
      {"\"step\":4", "\"step\":-4", "key 'step'"},
      {"\"step\":4", "\"step\":4.5", "key 'step'"},
      {"\"world_size\":1", "\"world_size\":0", "key 'world_size'"},
      {"\"state_file\":\"state-00000004.bin\"", "\"state_file\":\"../x\"", "key 'state_file'"},
      {"\"state_bytes\":8192", "\"state_bytes\":-1", "key 'state_bytes'"},
      {"\"meta\":{\"seed\":7}", "\"meta\":[]", "key 'meta'"},
      {"\"tier\":\"nvme\"", "\"tier\":\"disk\"", "key 'tensors[0].tier'"},
      {"\"shape\":[2,3]", "\"shape\":[2,-3]", "key 'tensors[0].shape[1]'"},
      {"\"xxh64\":\"00000000deadbeef\"", "\"xxh64\":\"zz\"", "key 'tensors[0].xxh64'"},
      {"\"xxh64\":\"1\"", "\"xxh64\":\"00000000000000001\"", "key 'tensors[1].xxh64'"},
      {"\"offset\":4096", "\"offset\":18446744073709551615", "key 'tensors[1].offset'"},
      {"\"offset\":4096", "\"offset\":8180", "key 'tensors[1].offset'"},
      {"\"name\":\"embed.adam_m\"", "\"name\":\"embed.param\"", "appears twice"},
      {"\"format\":\"tiermem-train-checkpoint\",", "", "missing key 'format'"},
      // shape, dtype and bytes must agree (found by the new-user trial: edits went unnoticed)
      {"\"shape\":[2,3]", "\"shape\":[2,4]", "key 'tensors[0].bytes' = 24 does not match"},
      {"\"dtype\":\"f32\",\"shape\":[2,3]", "\"dtype\":\"bf16\",\"shape\":[2,3]",
       "key 'tensors[0].bytes' = 24 does not match"},
      {"\"dtype\":\"f32\",\"shape\":[2,3]", "\"dtype\":\"q4\",\"shape\":[2,3]",
       "key 'tensors[0].dtype' = 'q4'"},
      {"\"shape\":[2,3]", "\"shape\":[4294967296,4294967296,4]", "overflowing"},
  };
  for (const Case& c : cases) {
    const std::string e = error_of(with(kGood, c.from, c.to));
    EXPECT_NE(e.find(c.expect), std::string::npos) << c.to << " -> " << e;
    EXPECT_NE(e.find("ck/rank0/manifest.json"), std::string::npos) << e;
  }
  EXPECT_NE(error_of("[1,2]").find("must be a JSON object"), std::string::npos);
  EXPECT_NE(error_of("{\"format\":").find("not valid JSON"), std::string::npos);
}

}  // namespace
