// Chat templates against jinja2's rendering of the real templates
// (tests/fixtures/tokenizers/chat_templates.jsonl), and their error cases.
#include "gpu_worker/tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include <fstream>

#include "nlohmann/json.hpp"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

TEST(ChatTemplate, RendersLikeJinja) {
  std::ifstream in(testing::FixturePath("tokenizers/chat_templates.jsonl"));
  ASSERT_TRUE(in.good());
  std::string line;
  int rows = 0;
  while (std::getline(in, line)) {
    const auto row = nlohmann::json::parse(line);
    const std::string family = row["family"];
    const std::string bos = family == "llama3"   ? "<|begin_of_text|>"
                            : family == "llama2" ? "<s>"
                                                 : "<|im_start|>";
    const std::string eos = family == "llama3"   ? "<|eot_id|>"
                            : family == "llama2" ? "</s>"
                                                 : "<|im_end|>";
    auto t = ChatTemplate::FromJinja(row["template"].get<std::string>(), bos, eos);
    ASSERT_TRUE(t.ok()) << family << ": " << t.status();
    std::vector<ChatMessage> messages;
    for (const auto& m : row["messages"]) messages.push_back({m["role"], m["content"]});
    auto rendered = t->Render(messages, row["add_generation_prompt"].get<bool>());
    ASSERT_TRUE(rendered.ok()) << rendered.status();
    EXPECT_EQ(*rendered, row["rendered"].get<std::string>()) << family << " row " << rows;
    ++rows;
  }
  EXPECT_EQ(rows, 24);
}

TEST(ChatTemplate, ErrorsNameTheProblem) {
  auto unknown = ChatTemplate::FromJinja("{{ messages[0].content }}", "", "");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(unknown.status().message().find("not recognized"), std::string::npos);
  EXPECT_EQ(ChatTemplate::FromJinja("", "", "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ChatTemplate::ForFormat("vicuna", "", "").status().code(),
            absl::StatusCode::kInvalidArgument);

  auto llama2 = ChatTemplate::ForFormat("llama2", "<s>", "</s>");
  ASSERT_TRUE(llama2.ok());
  std::vector<ChatMessage> bad = {{"user", "a"}, {"user", "b"}};
  auto r = llama2->Render(bad, true);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("alternate"), std::string::npos);
}

}  // namespace
}  // namespace infinigen
