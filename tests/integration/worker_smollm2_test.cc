// infinigen-worker on the real SmolLM2-135M-Instruct (GGUF, tokenizer inside): a text prompt and
// a chat conversation stream the same tokens as the local engine given the same prompt ids, and
// the streamed text deltas concatenate to the tokenizer's decoding of those tokens.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "gpu_worker/engine/generator.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/model/loaded_model.h"
#include "gpu_worker/tokenizer/chat_template.h"
#include "infinigen/worker/v1/worker.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/support/fixture_model.h"
#include "tests/support/process.h"
#include "tests/support/test_paths.h"
#include "tests/support/worker_stream.h"

namespace infinigen {
namespace {

namespace wv1 = worker::v1;

using testing::StreamWorker;

// A SmolLM2 worker over an in-process KV store (full policy, one thread) with `extra` flags.
struct SmolLm2Worker {
  explicit SmolLm2Worker(const std::vector<std::string>& extra)
      : port(testing::FreePort()),
        process("infinigen-worker", Flags(port, extra), port),
        stub(wv1::Worker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                      grpc::InsecureChannelCredentials()))) {}
  static std::vector<std::string> Flags(int port, const std::vector<std::string>& extra) {
    std::vector<std::string> f = {"--model=" + testing::SmolLm2Path(),
                                  "--listen=127.0.0.1:" + std::to_string(port),
                                  "--kv_transport=in-process",
                                  "--policy=full",
                                  "--threads=1",
                                  "--kv_capacity_mb=256"};
    f.insert(f.end(), extra.begin(), extra.end());
    return f;
  }
  int port;
  testing::ServerProcess process;
  std::unique_ptr<wv1::Worker::Stub> stub;
};

TEST(WorkerSmolLm2, TextAndChatStreamTheLocalEnginesTokensAndText) {
  const std::string model_path = testing::SmolLm2Path();
  IG_REQUIRE_FILE(model_path, "SmolLM2 GGUF (scripts/setup.sh fetches it)");
  SmolLm2Worker worker({});
  ASSERT_TRUE(worker.process.running());
  auto& stub = worker.stub;

  BackendSpec flags;
  flags.threads = 1;
  auto loaded = LoadModel(model_path, flags);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto tokenizer = LoadTokenizer(*loaded->checkpoint);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  auto local = [&](const std::vector<int32_t>& prompt, int max_new) {
    BackendKvCache cache(*loaded->backend, loaded->model->kv_shape());
    GenerateOptions o;
    o.max_new_tokens = max_new;
    o.sampling.temperature = 0;
    auto r = Generate(*loaded->model, cache, 1, prompt, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->tokens : std::vector<int32_t>{};
  };

  // A text prompt: encoded with BOS where the model wants it.
  wv1::GenerateRequest text;
  text.set_text("The capital of France is");
  text.mutable_sampling()->set_temperature(0);
  text.mutable_stopping()->set_max_new_tokens(24);
  const testing::WorkerStreamResult a = StreamWorker(*stub, text);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  EXPECT_EQ(a.tokens, local((*tokenizer)->Encode("The capital of France is", true), 24));
  EXPECT_EQ(a.text, (*tokenizer)->Decode(a.tokens));
  EXPECT_FALSE(a.text.empty());

  // Tokenize: pieces are text (" world", not the vocabulary's "Ġworld") and concatenate to the
  // decoding, multi-byte characters included.
  {
    grpc::ClientContext c;
    infinigen::v1::TokenizeRequest t;
    t.set_text(
        "Hello world, caf\xc3\xa9 \xe2\x82\xac"
        "5 \xf0\x9f\x98\x80!");
    infinigen::v1::TokenizeResponse out;
    const grpc::Status st = stub->Tokenize(&c, t, &out);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(out.pieces_size(), out.token_ids_size());
    std::string joined;
    for (const std::string& p : out.pieces()) {
      EXPECT_EQ(p.find("\xc4\xa0"), std::string::npos) << p;  // U+0120 'Ġ', GPT-2's space mark
      joined += p;
    }
    const std::vector<int32_t> ids(out.token_ids().begin(), out.token_ids().end());
    EXPECT_EQ(joined, (*tokenizer)->Decode(ids));
    EXPECT_NE(std::find(out.pieces().begin(), out.pieces().end(), " world"), out.pieces().end());
  }

  // Logprobs carry each token's text (the tokenizer's decoding of that id alone): the generated
  // token's, every alternative's and every prompt token's.
  {
    wv1::GenerateRequest r = text;
    r.mutable_stopping()->set_max_new_tokens(6);
    r.mutable_sampling()->set_logprobs(3);
    r.mutable_sampling()->set_prompt_logprobs(2);
    grpc::ClientContext c;
    auto reader = stub->Generate(&c, r);
    wv1::GenerateResponse msg;
    auto decoded = [&](int32_t id) { return (*tokenizer)->Decode(std::vector<int32_t>{id}); };
    int entries = 0, prompt_entries = 0;
    std::string joined;
    while (reader->Read(&msg)) {
      ASSERT_EQ(msg.logprobs_size(), msg.token_ids_size());
      for (int i = 0; i < msg.logprobs_size(); ++i) {
        const infinigen::v1::Logprobs& lp = msg.logprobs(i);
        ASSERT_TRUE(lp.has_token());
        EXPECT_EQ(lp.token(), decoded(msg.token_ids(i)));
        joined += lp.token();
        ASSERT_EQ(lp.top_size(), 3);
        for (const auto& t : lp.top()) {
          ASSERT_TRUE(t.has_token());
          EXPECT_EQ(t.token(), decoded(t.token_id()));
        }
        ++entries;
      }
      for (const infinigen::v1::Logprobs& lp : msg.prompt_logprobs()) {
        ASSERT_TRUE(lp.has_token());
        EXPECT_EQ(lp.token(), decoded(lp.token_id()));
        for (const auto& t : lp.top()) EXPECT_EQ(t.token(), decoded(t.token_id()));
        ++prompt_entries;
      }
    }
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_EQ(entries, 6);
    EXPECT_EQ(prompt_entries,
              static_cast<int>((*tokenizer)->Encode("The capital of France is", true).size()) - 1);
    EXPECT_EQ(joined, a.text.substr(0, joined.size()));  // the first 6 of the same greedy tokens
  }

  // A conversation: rendered with the model's own (ChatML) template.
  wv1::GenerateRequest chat;
  auto* m = chat.mutable_messages()->add_messages();
  m->set_role("user");
  m->set_content("What is the largest planet of the solar system?");
  chat.mutable_sampling()->set_temperature(0);
  chat.mutable_stopping()->set_max_new_tokens(24);
  chat.set_skip_special_tokens(true);
  const testing::WorkerStreamResult b = StreamWorker(*stub, chat);
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  const std::string bos = (*tokenizer)->TokenText((*tokenizer)->bos_id());
  const std::string eos = (*tokenizer)->TokenText((*tokenizer)->eos_ids()[0]);
  auto tmpl = ChatTemplate::FromJinja((*tokenizer)->chat_template(), bos, eos);
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  std::vector<ChatMessage> messages = {{"user", m->content()}};
  auto rendered = tmpl->Render(messages, true);
  ASSERT_TRUE(rendered.ok());
  EXPECT_EQ(b.tokens, local((*tokenizer)->Encode(*rendered, false), 24));
  EXPECT_EQ(b.text, (*tokenizer)->Decode(b.tokens, /*skip_special=*/true));
}

// The embedded default's storage (q4_1 weights, bf16 K/V) through the store-backed worker: the
// rows it fetches from the KV store (converted as they were appended, the current token's
// converted in the step) give the tokens of the local engine's resident bf16 cache. A prompt of
// several hundred tokens, so that decode attention spans several chunks.
TEST(WorkerSmolLm2, Bf16KvThroughTheStoreStreamsTheLocalEnginesTokens) {
  const std::string model_path = testing::SmolLm2Path();
  IG_REQUIRE_FILE(model_path, "SmolLM2 GGUF (scripts/setup.sh fetches it)");
  SmolLm2Worker worker({"--cpu_weights=q4_1", "--cpu_kv=bf16"});
  ASSERT_TRUE(worker.process.running());
  auto& stub = worker.stub;
  BackendSpec flags;
  flags.threads = 1;
  flags.cpu_weights = "q4_1";
  flags.cpu_kv = "bf16";
  auto loaded = LoadModel(model_path, flags);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->model->kv_shape().dtype, DType::kBF16);
  const std::vector<int32_t> prompt =
      testing::RandomTokens(600, loaded->model->config().vocab_size, 17);
  BackendKvCache cache(*loaded->backend, loaded->model->kv_shape());
  GenerateOptions o;
  o.max_new_tokens = 32;
  o.ignore_eos = true;
  o.sampling.temperature = 0;
  auto want = Generate(*loaded->model, cache, 1, prompt, o);
  ASSERT_TRUE(want.ok()) << want.status();

  wv1::GenerateRequest r;
  for (int32_t t : prompt) r.mutable_token_ids()->add_ids(t);
  r.mutable_sampling()->set_temperature(0);
  r.mutable_stopping()->set_max_new_tokens(32);
  r.mutable_stopping()->set_ignore_eos(true);
  const testing::WorkerStreamResult got = StreamWorker(*stub, r);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens, want->tokens);
  EXPECT_EQ(got.last.usage().backend(), "cpu-q4_1 (bf16 K/V)");
}

// JSON mode (sampling.response_format JSON_OBJECT) on the worker: the answer is one object and
// ends when it closes; a stream resumed after k of its tokens (what the router sends the next
// worker after a failover) replays them through the mask and continues with exactly the rest;
// resumed tokens that are no JSON prefix are refused, and a resume whose object is whole ends at
// once.
TEST(WorkerSmolLm2, JsonModeResumesThroughTheMask) {
  const std::string model_path = testing::SmolLm2Path();
  IG_REQUIRE_FILE(model_path, "SmolLM2 GGUF (scripts/setup.sh fetches it)");
  SmolLm2Worker worker({});
  ASSERT_TRUE(worker.process.running());
  auto& stub = worker.stub;
  wv1::GenerateRequest r;
  infinigen::v1::ChatMessage* m = r.mutable_messages()->add_messages();
  m->set_role("user");
  m->set_content("Describe a dog as JSON with fields name, age and color.");
  r.mutable_sampling()->set_temperature(0);
  r.mutable_sampling()->set_response_format(infinigen::v1::RESPONSE_FORMAT_JSON_OBJECT);
  r.mutable_stopping()->set_max_new_tokens(150);
  const testing::WorkerStreamResult full = StreamWorker(*stub, r);
  ASSERT_TRUE(full.status.ok()) << full.status.error_message();
  EXPECT_EQ(full.last.finish_reason(), infinigen::v1::FINISH_REASON_STOP) << full.text;
  EXPECT_FALSE(full.last.has_stop()) << "the object closed it, not a stop token";
  EXPECT_TRUE(nlohmann::json::parse(full.text, nullptr, false).is_object()) << full.text;
  ASSERT_GE(full.tokens.size(), 6u);

  const size_t k = full.tokens.size() / 2;
  wv1::GenerateRequest resumed = r;
  for (size_t i = 0; i < k; ++i) resumed.add_resume_token_ids(full.tokens[i]);
  const testing::WorkerStreamResult rest = StreamWorker(*stub, resumed);
  ASSERT_TRUE(rest.status.ok()) << rest.status.error_message();
  EXPECT_EQ(rest.tokens, std::vector<int32_t>(full.tokens.begin() + k, full.tokens.end()));
  EXPECT_EQ(rest.last.finish_reason(), infinigen::v1::FINISH_REASON_STOP);

  wv1::GenerateRequest whole = r;
  for (int32_t t : full.tokens) whole.add_resume_token_ids(t);
  const testing::WorkerStreamResult none = StreamWorker(*stub, whole);
  ASSERT_TRUE(none.status.ok()) << none.status.error_message();
  EXPECT_TRUE(none.tokens.empty());
  EXPECT_EQ(none.last.finish_reason(), infinigen::v1::FINISH_REASON_STOP);

  wv1::GenerateRequest broken = r;
  broken.add_resume_token_ids(full.tokens.back());  // the closing brace first
  const testing::WorkerStreamResult refused = StreamWorker(*stub, broken);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << refused.status.error_message();
  EXPECT_NE(refused.status.error_message().find("JSON"), std::string::npos);
}

}  // namespace
}  // namespace infinigen
