// Walks docs/config.md's table "DeepSpeed keys: honoured, derived or warned" and checks that
// parse_config treats each key as the table says: honoured and derived keys are read (written as
// "auto", the key is consumed and listed in Config::auto_keys, and nothing warns about it);
// warned keys are consumed with one warning (Config::inert_keys); no key is unknown.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tiermem/config.h"

#ifndef TIERMEM_CONFIG_MD
#error "TIERMEM_CONFIG_MD must name docs/config.md"
#endif

namespace tiermem {
namespace {

struct Row {
  std::string key, status;
};

// "a.offload_{param,optimizer}.b" -> both keys.
std::vector<std::string> expand(const std::string& key) {
  const auto open = key.find('{'), close = key.find('}');
  if (open == std::string::npos || close == std::string::npos) return {key};
  std::vector<std::string> out;
  std::stringstream alts(key.substr(open + 1, close - open - 1));
  for (std::string alt; std::getline(alts, alt, ',');)
    out.push_back(key.substr(0, open) + alt + key.substr(close + 1));
  return out;
}

std::vector<Row> table_rows() {
  std::ifstream in(TIERMEM_CONFIG_MD);
  EXPECT_TRUE(in) << "cannot read " << TIERMEM_CONFIG_MD;
  std::vector<Row> rows;
  bool inside = false;
  const std::regex row(R"(^\| `([^`]+)` \| (honoured|derived|warned) \|)");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("## ", 0) == 0)
      inside = line.find("DeepSpeed keys: honoured") != std::string::npos;
    std::smatch m;
    if (!inside || !std::regex_search(line, m, row)) {
      if (inside && line.rfind("| `", 0) == 0) ADD_FAILURE() << "row without a status: " << line;
      continue;
    }
    for (const std::string& k : expand(m[1])) rows.push_back({k, m[2]});
  }
  return rows;
}

// {"a": {"b": "auto"}} for "a.b".
std::string doc_with(const std::string& key) {
  nlohmann::json doc = nlohmann::json::object();
  nlohmann::json* at = &doc;
  std::stringstream parts(key);
  std::vector<std::string> names;
  for (std::string p; std::getline(parts, p, '.');) names.push_back(p);
  for (std::size_t i = 0; i + 1 < names.size(); ++i) at = &(*at)[names[i]];
  (*at)[names.back()] = "auto";
  return doc.dump();
}

TEST(ConfigDocs, EveryDeepSpeedKeyIsParsedAsTheTableSays) {
  const std::vector<Row> rows = table_rows();
  ASSERT_GT(rows.size(), 60u) << "the table in " << TIERMEM_CONFIG_MD << " was not found";
  for (const Row& r : rows) {
    SCOPED_TRACE(r.key + " (" + r.status + ")");
    const Config c = parse_config(doc_with(r.key), "<docs table>");
    EXPECT_TRUE(c.unknown_keys.empty()) << "unknown: " << c.unknown_keys.front();
    int inert = 0;
    for (const InertKey& k : c.inert_keys) inert += k.key == r.key;
    if (r.status == "warned") {
      EXPECT_EQ(inert, 1) << "expected one warning";
      EXPECT_EQ(c.inert_keys.size(), 1u);
    } else {
      EXPECT_EQ(inert, 0) << "a key the table calls " << r.status << " warns";
      EXPECT_TRUE(c.inert_keys.empty());
      EXPECT_TRUE(c.is_auto(r.key)) << "not read by the parser";
    }
  }
}

}  // namespace
}  // namespace tiermem
