// The OpenAI-compatible HTTP front door of a real `infinigen serve` process (the tiny Llama
// fixture, prompts as token ids): what HTTP answers equals what the gRPC API answers for the same
// request, streamed and whole; errors carry OpenAI's codes; a client that hangs up ends its
// generation. The official openai client's test is tests/integration/openai_client_test.py.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <fstream>
#include <map>
#include <thread>
#include <tuple>

#include "infinigen/v1/generation.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/support/certificates.h"
#include "tests/support/process.h"
#include "tests/support/test_paths.h"
#include "tests/support/token_request.h"

namespace infinigen {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using nlohmann::json;
using testing::FreePort;
using testing::ServerProcess;

const char* kModel = "hf/llama31_gqa";

struct Reply {
  int status = 0;
  std::string body;
  std::string retry_after;
  std::string content_type;
  json Json() const { return json::parse(body, nullptr, false); }
};

// One request on a connection of its own (`stream`: connected, and past its TLS handshake when
// it has one); status 0 when no answer came.
template <class Stream>
Reply Exchange(Stream& socket, http::verb method, const std::string& target,
               const std::string& body, const std::string& authorization) {
  beast::error_code ec;
  http::request<http::string_body> req{method, target, 11};
  req.set(http::field::host, "127.0.0.1");
  req.set(http::field::content_type, "application/json");
  if (!authorization.empty()) req.set(http::field::authorization, authorization);
  req.body() = body;
  req.prepare_payload();
  http::write(socket, req, ec);  // a server may answer (413) and stop reading before the end
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(64 << 20);
  http::read(socket, buffer, parser, ec);
  if (ec) return {};
  const auto& res = parser.get();
  Reply r;
  r.status = res.result_int();
  r.body = res.body();
  r.retry_after = std::string(res[http::field::retry_after]);
  r.content_type = std::string(res[http::field::content_type]);
  return r;
}

Reply Call(int port, http::verb method, const std::string& target, const std::string& body,
           const std::string& authorization = "") {
  net::io_context io;
  tcp::socket socket(io);
  beast::error_code ec;
  socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port), ec);
  if (ec) return {};
  return Exchange(socket, method, target, body, authorization);
}

// Over TLS, trusting only the CA in `ca_file` and checking that the server is "localhost".
// `client_cert` (a folder of MakeCertificates, or empty): present its service.pem/.key.
Reply CallTls(int port, const std::string& ca_file, http::verb method, const std::string& target,
              const std::string& body, const std::string& client_cert = "") {
  net::io_context io;
  net::ssl::context tls(net::ssl::context::tls_client);
  beast::error_code ec;
  tls.load_verify_file(ca_file, ec);
  if (ec) return {};
  if (!client_cert.empty()) {
    tls.use_certificate_chain_file(client_cert + "/service.pem", ec);
    if (!ec) tls.use_private_key_file(client_cert + "/service.key", net::ssl::context::pem, ec);
    if (ec) return {};
  }
  tls.set_verify_mode(net::ssl::verify_peer);
  tls.set_verify_callback(net::ssl::host_name_verification("localhost"));
  net::ssl::stream<tcp::socket> stream(io, tls);
  stream.next_layer().connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port), ec);
  if (!ec) stream.handshake(net::ssl::stream_base::client, ec);
  if (ec) return {};
  return Exchange(stream, method, target, body, "");
}

Reply Post(int port, const std::string& target, const json& body,
           const std::string& authorization = "") {
  return Call(port, http::verb::post, target, body.dump(), authorization);
}

// The JSON payloads of a server-sent event stream ("data: ..." lines), [DONE] included as a
// string.
std::vector<json> Events(const std::string& body) {
  std::vector<json> out;
  size_t at = 0;
  while ((at = body.find("data: ", at)) != std::string::npos) {
    const size_t end = body.find("\n\n", at);
    const std::string data = body.substr(at + 6, end - at - 6);
    out.push_back(data == "[DONE]" ? json("[DONE]") : json::parse(data, nullptr, false));
    at = end;
  }
  return out;
}

// The token logprobs of each choice (by `index`) of a completions event stream, in order.
std::vector<std::vector<float>> StreamedLogprobs(const std::vector<json>& events, size_t choices) {
  std::vector<std::vector<float>> out(choices);
  for (const json& e : events) {
    if (!e.is_object() || e["choices"].empty()) continue;
    const json& c = e["choices"][0];
    if (c["logprobs"].is_object()) {
      for (const json& lp : c["logprobs"]["token_logprobs"]) {
        out.at(c["index"].get<size_t>()).push_back(lp.get<float>());
      }
    }
  }
  return out;
}

struct GrpcResult {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<v1::Logprobs> token_logprobs;
  std::vector<v1::Logprobs> prompt_logprobs;
  v1::GenerateResponse last;
};

GrpcResult Grpc(int port, const v1::GenerateRequest& request) {
  auto stub = v1::Generation::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, request);
  GrpcResult r;
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
    for (int32_t t : m.token_ids()) r.tokens.push_back(t);
    for (const v1::Logprobs& lp : m.logprobs()) r.logprobs.push_back(lp.logprob());
    for (const v1::Logprobs& lp : m.logprobs()) r.token_logprobs.push_back(lp);
    for (const v1::Logprobs& lp : m.prompt_logprobs()) r.prompt_logprobs.push_back(lp);
    r.last = m;
  }
  EXPECT_TRUE(reader->Finish().ok());
  return r;
}

class OpenAiHttp : public ::testing::Test {
 protected:
  // `infinigen serve` of the tiny fixture, or of `model`.
  void Start(std::vector<std::string> extra = {}, std::string model = "") {
    if (model.empty()) model = testing::FixturePath(kModel);
    grpc_port_ = FreePort();
    http_port_ = FreePort();
    std::vector<std::string> args = {
        "serve", "--model=" + model, "--listen=127.0.0.1:" + std::to_string(grpc_port_),
        "--http-listen=127.0.0.1:" + std::to_string(http_port_), "--threads=1"};
    args.insert(args.end(), extra.begin(), extra.end());
    serve_ = std::make_unique<ServerProcess>("infinigen", args, grpc_port_);
    ASSERT_TRUE(serve_->running()) << "see " << serve_->log_path();
  }
  int grpc_port_ = 0, http_port_ = 0;
  std::unique_ptr<ServerProcess> serve_;
};

TEST_F(OpenAiHttp, CompletionsEqualTheGrpcApiWholeAndStreamed) {
  Start();
  const std::vector<int32_t> prompt = {1, 5, 9, 2, 7};
  v1::GenerateRequest g;
  testing::FillTokenRequest(g, prompt, 12, 0.0f, 0);
  g.mutable_sampling()->set_logprobs(3);
  const GrpcResult want = Grpc(grpc_port_, g);
  ASSERT_EQ(want.tokens.size(), 12u);

  const json request = {{"prompt", prompt},
                        {"max_tokens", 12},
                        {"temperature", 0},
                        {"logprobs", 3},
                        {"model", "llama31_gqa"}};
  const Reply whole = Post(http_port_, "/v1/completions", request);
  ASSERT_EQ(whole.status, 200) << whole.body;
  EXPECT_EQ(whole.content_type, "application/json");
  const json w = whole.Json();
  EXPECT_EQ(w["object"], "text_completion");
  EXPECT_EQ(w["model"], "llama31_gqa");
  const json& choice = w["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "length");
  ASSERT_EQ(choice["logprobs"]["token_logprobs"].size(), 12u);
  for (size_t i = 0; i < 12; ++i) {
    EXPECT_FLOAT_EQ(choice["logprobs"]["token_logprobs"][i].get<float>(), want.logprobs[i]) << i;
    EXPECT_EQ(choice["logprobs"]["top_logprobs"][i].size(), 3u) << i;
  }
  EXPECT_EQ(w["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(w["usage"]["completion_tokens"], 12);
  EXPECT_EQ(w["usage"]["total_tokens"], 17);
  EXPECT_EQ(w["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

  json streamed = request;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  const Reply s = Post(http_port_, "/v1/completions", streamed);
  ASSERT_EQ(s.status, 200) << s.body;
  EXPECT_EQ(s.content_type, "text/event-stream");
  const std::vector<json> events = Events(s.body);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::vector<float> logprobs;
  std::string finish;
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    const json& c = events[i]["choices"][0];
    EXPECT_EQ(events[i]["id"], events[0]["id"]);
    if (c["logprobs"].is_object()) {
      for (const json& lp : c["logprobs"]["token_logprobs"]) logprobs.push_back(lp.get<float>());
    }
    if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
  }
  EXPECT_EQ(finish, "length");
  ASSERT_EQ(logprobs.size(), 12u);
  for (size_t i = 0; i < 12; ++i) EXPECT_FLOAT_EQ(logprobs[i], want.logprobs[i]) << i;
  const json& usage = events[events.size() - 2];
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 12);
}

// OpenAI's presence and frequency penalties reach the worker through both doors. Each greedy
// token beats the 20 most likely tokens once each score is its raw log-probability less
// frequency x (the times it was generated before) and presence (if it was): OpenAI's formula,
// written out here; and HTTP's tokens are gRPC's.
TEST_F(OpenAiHttp, PresenceAndFrequencyPenaltiesDecideGreedyTokensThroughBothDoors) {
  Start();
  const std::vector<int32_t> prompt = {1, 5, 9, 2, 7};
  constexpr int kTokens = 24;
  constexpr float kPresence = -1.0f, kFrequency = 0.6f;  // repeats, then not
  v1::GenerateRequest g;
  testing::FillTokenRequest(g, prompt, kTokens, 0.0f, 0);
  g.mutable_sampling()->set_logprobs(20);
  const GrpcResult plain = Grpc(grpc_port_, g);
  g.mutable_sampling()->set_presence_penalty(kPresence);
  g.mutable_sampling()->set_frequency_penalty(kFrequency);
  const GrpcResult penalized = Grpc(grpc_port_, g);
  ASSERT_EQ(plain.tokens.size(), static_cast<size_t>(kTokens));
  ASSERT_EQ(penalized.token_logprobs.size(), static_cast<size_t>(kTokens));
  EXPECT_NE(penalized.tokens, plain.tokens);
  std::map<int32_t, int> generated;
  int overruled = 0;  // tokens that were not the most likely
  for (int i = 0; i < kTokens; ++i) {
    auto score = [&](int32_t id, float logprob) {
      const int c = generated.count(id) ? generated[id] : 0;
      return logprob - kFrequency * static_cast<float>(c) - (c > 0 ? kPresence : 0.0f);
    };
    const v1::Logprobs& lp = penalized.token_logprobs[i];
    const int32_t chosen = penalized.tokens[i];
    for (const v1::TokenLogprob& alt : lp.top()) {
      EXPECT_GE(score(chosen, lp.logprob()) + 1e-5f, score(alt.token_id(), alt.logprob()))
          << "token " << i << ": " << chosen << " over " << alt.token_id();
    }
    overruled += lp.rank() > 1;
    generated[chosen] += 1;
  }
  EXPECT_GT(overruled, 0);

  const Reply http = Post(http_port_, "/v1/completions",
                          {{"prompt", prompt},
                           {"max_tokens", kTokens},
                           {"temperature", 0},
                           {"logprobs", 1},
                           {"ignore_eos", true},
                           {"presence_penalty", kPresence},
                           {"frequency_penalty", kFrequency}});
  ASSERT_EQ(http.status, 200) << http.body;
  const json body = http.Json();
  const json& lps = body["choices"][0]["logprobs"]["token_logprobs"];
  ASSERT_EQ(lps.size(), static_cast<size_t>(kTokens));
  for (int i = 0; i < kTokens; ++i) {
    EXPECT_FLOAT_EQ(lps[i].get<float>(), penalized.logprobs[i]) << i;
  }
  const Reply too_much = Post(http_port_, "/v1/completions",
                              {{"prompt", prompt}, {"max_tokens", 2}, {"presence_penalty", 2.5}});
  EXPECT_EQ(too_much.status, 400);
  EXPECT_EQ(too_much.Json()["error"]["param"], "presence_penalty") << too_much.body;
}

// vLLM's prompt_logprobs: per completion choice (whole and in the first streamed chunk) and at
// the top of a chat completion, [null, {"<id>": {logprob, rank, decoded_token}, ...}, ...], the
// prompt token's entry equal to the gRPC API's GenerateResponse.prompt_logprobs.
TEST_F(OpenAiHttp, PromptLogprobsEqualTheGrpcApis) {
  Start();
  const std::vector<int32_t> prompt = {1, 5, 9, 2, 7, 11};
  v1::GenerateRequest g;
  testing::FillTokenRequest(g, prompt, 3, 0.0f, 0);
  g.mutable_sampling()->set_prompt_logprobs(2);
  const GrpcResult want = Grpc(grpc_port_, g);
  ASSERT_EQ(want.prompt_logprobs.size(), prompt.size() - 1);
  auto check = [&](const json& got) {
    ASSERT_TRUE(got.is_array()) << got.dump();
    ASSERT_EQ(got.size(), prompt.size());
    EXPECT_TRUE(got[0].is_null());
    for (size_t j = 1; j < prompt.size(); ++j) {
      const v1::Logprobs& lp = want.prompt_logprobs[j - 1];
      const json& at = got[j];
      ASSERT_TRUE(at.contains(std::to_string(prompt[j]))) << at.dump();
      const json& mine = at[std::to_string(prompt[j])];
      EXPECT_FLOAT_EQ(mine["logprob"].get<float>(), lp.logprob()) << j;
      EXPECT_EQ(mine["rank"].get<int>(), lp.rank()) << j;
      EXPECT_TRUE(mine["decoded_token"].is_string());
      EXPECT_LE(at.size(), 3u);  // the prompt token and 2 alternatives, one entry if among them
      for (const v1::TokenLogprob& t : lp.top()) {
        EXPECT_FLOAT_EQ(at[std::to_string(t.token_id())]["logprob"].get<float>(), t.logprob());
      }
    }
  };
  const json request = {
      {"prompt", prompt}, {"max_tokens", 3}, {"temperature", 0}, {"prompt_logprobs", 2}};
  const Reply whole = Post(http_port_, "/v1/completions", request);
  ASSERT_EQ(whole.status, 200) << whole.body;
  check(whole.Json()["choices"][0]["prompt_logprobs"]);
  json streamed = request;
  streamed["stream"] = true;
  const Reply s = Post(http_port_, "/v1/completions", streamed);
  ASSERT_EQ(s.status, 200) << s.body;
  const std::vector<json> events = Events(s.body);
  ASSERT_GE(events.size(), 2u);
  check(events[0]["choices"][0]["prompt_logprobs"]);
  for (size_t i = 1; i + 1 < events.size(); ++i) {
    EXPECT_FALSE(events[i]["choices"][0].contains("prompt_logprobs")) << i;
  }
  const Reply bad = Post(http_port_, "/v1/completions",
                         {{"prompt", prompt}, {"max_tokens", 3}, {"prompt_logprobs", 21}});
  EXPECT_EQ(bad.status, 400) << bad.body;
  EXPECT_EQ(bad.Json()["error"]["param"], "prompt_logprobs") << bad.body;
}

// vLLM's /tokenize and /detokenize: a prompt's and a conversation's tokens are the gRPC API's
// Tokenize and as many as a completion of them counts (usage.prompt_tokens), each token's text
// adds up to the prompt, /detokenize gives the prompt back; bad bodies are 400s naming the field.
TEST_F(OpenAiHttp, TokenizeAndDetokenizeAreTheServersTokenizer) {
  const std::string smollm2 = testing::SmolLm2Path();
  IG_REQUIRE_FILE(smollm2, "SmolLM2 GGUF (scripts/setup.sh fetches it)");
  Start({}, smollm2);
  const std::string text = "The lighthouse keeper's log, day 12: fog again.";
  const Reply t = Post(http_port_, "/tokenize", {{"prompt", text}, {"return_token_strs", true}});
  ASSERT_EQ(t.status, 200) << t.body;
  const json tj = t.Json();
  auto stub = v1::Generation::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port_),
                                                          grpc::InsecureChannelCredentials()));
  v1::TokenizeRequest tr;
  tr.set_text(text);
  tr.set_add_special(true);
  v1::TokenizeResponse want;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Tokenize(&ctx, tr, &want).ok());
  }
  ASSERT_GT(want.token_ids_size(), 5);
  EXPECT_EQ(tj["tokens"].get<std::vector<int32_t>>(),
            std::vector<int32_t>(want.token_ids().begin(), want.token_ids().end()));
  EXPECT_EQ(tj["count"], want.token_ids_size());
  EXPECT_GT(tj["max_model_len"].get<int64_t>(), 0);
  std::string joined;
  for (const json& piece : tj["token_strs"]) joined += piece.get<std::string>();
  EXPECT_EQ(joined, text);
  const Reply completion =
      Post(http_port_, "/v1/completions", {{"prompt", text}, {"max_tokens", 1}});
  ASSERT_EQ(completion.status, 200) << completion.body;
  EXPECT_EQ(completion.Json()["usage"]["prompt_tokens"], tj["count"]);

  const json messages = {{{"role", "system"}, {"content", "Be brief."}},
                         {{"role", "user"}, {"content", "Name a color."}}};
  const Reply chat_tokens = Post(http_port_, "/tokenize", {{"messages", messages}});
  ASSERT_EQ(chat_tokens.status, 200) << chat_tokens.body;
  EXPECT_EQ(chat_tokens.Json()["token_strs"], nullptr);
  const Reply chat =
      Post(http_port_, "/v1/chat/completions", {{"messages", messages}, {"max_tokens", 1}});
  ASSERT_EQ(chat.status, 200) << chat.body;
  EXPECT_EQ(chat.Json()["usage"]["prompt_tokens"], chat_tokens.Json()["count"]);

  const Reply back = Post(http_port_, "/detokenize", {{"tokens", tj["tokens"]}});
  ASSERT_EQ(back.status, 200) << back.body;
  EXPECT_EQ(back.Json()["prompt"], text);

  for (const auto& [route, body, param] : std::vector<std::tuple<std::string, json, std::string>>{
           {"/tokenize", json::object(), "prompt"},
           {"/tokenize", {{"prompt", 5}}, "prompt"},
           {"/tokenize", {{"prompt", "a"}, {"messages", messages}}, "messages"},
           {"/tokenize",
            {{"messages", messages}, {"add_generation_prompt", false}},
            "add_generation_prompt"},
           {"/detokenize", {{"tokens", "12"}}, "tokens"},
           {"/detokenize", {{"tokens", {1, -2}}}, "tokens"}}) {
    const Reply bad = Post(http_port_, route, body);
    EXPECT_EQ(bad.status, 400) << route << " " << body.dump() << ": " << bad.body;
    EXPECT_EQ(bad.Json()["error"]["param"], param) << bad.body;
  }
  const Reply outside = Post(http_port_, "/detokenize", {{"tokens", {1, 99999999}}});
  EXPECT_EQ(outside.status, 400) << outside.body;
  EXPECT_EQ(Post(http_port_, "/tokenize", {{"prompt", "a"}, {"model", "gpt-4"}}).status, 404);
  EXPECT_EQ(Call(http_port_, http::verb::get, "/tokenize", "").status, 405);
}

// A chat completion's prompt_logprobs are at its top (vLLM's place), whole and streamed: one
// per token of the rendered conversation.
TEST_F(OpenAiHttp, ChatPromptLogprobsAreAtTheTop) {
  const std::string smollm2 = testing::SmolLm2Path();
  IG_REQUIRE_FILE(smollm2, "SmolLM2 GGUF (scripts/setup.sh fetches it)");
  Start({}, smollm2);
  json chat = {{"messages", {{{"role", "user"}, {"content", "hello"}}}},
               {"max_tokens", 2},
               {"prompt_logprobs", 0}};
  const Reply c = Post(http_port_, "/v1/chat/completions", chat);
  ASSERT_EQ(c.status, 200) << c.body;
  const json w = c.Json();
  ASSERT_TRUE(w["prompt_logprobs"].is_array()) << c.body;
  EXPECT_EQ(w["prompt_logprobs"].size(), w["usage"]["prompt_tokens"].get<size_t>());
  EXPECT_TRUE(w["prompt_logprobs"][0].is_null());
  EXPECT_EQ(w["prompt_logprobs"][1].size(), 1u);  // the prompt token alone
  EXPECT_FALSE(w["choices"][0].contains("prompt_logprobs"));
  chat["stream"] = true;
  const Reply s = Post(http_port_, "/v1/chat/completions", chat);
  ASSERT_EQ(s.status, 200) << s.body;
  const std::vector<json> events = Events(s.body);
  json streamed;
  for (const json& e : events) {
    if (e.is_object() && e.contains("prompt_logprobs")) {
      EXPECT_TRUE(streamed.is_null()) << "sent twice";
      streamed = e["prompt_logprobs"];
    }
  }
  EXPECT_EQ(streamed, w["prompt_logprobs"]);
}

// n choices are n calls of the gRPC API, choice i sampled with the request's seed + i: each
// equals the gRPC API's answer for that seed, whole and streamed.
// With --tls-cert / --tls-key, the HTTP port speaks TLS with the gRPC port's certificate: whole
// and streamed answers come over it; plaintext and clients that do not trust the CA get none.
TEST_F(OpenAiHttp, TheHttpPortServesTlsWithTheGrpcPortsCertificate) {
  const std::string dir = testing::MakeCertificates("http_tls");
  const std::string other = testing::MakeCertificates("http_tls_other");
  Start({"--tls-cert=" + dir + "/service.pem", "--tls-key=" + dir + "/service.key"});
  json request = {{"prompt", {1, 2, 3, 4}}, {"max_tokens", 4}, {"temperature", 0}};
  const Reply whole =
      CallTls(http_port_, dir + "/ca.pem", http::verb::post, "/v1/completions", request.dump());
  ASSERT_EQ(whole.status, 200) << whole.body;
  EXPECT_EQ(whole.Json()["usage"]["completion_tokens"], 4) << whole.body;
  request["stream"] = true;
  const Reply streamed =
      CallTls(http_port_, dir + "/ca.pem", http::verb::post, "/v1/completions", request.dump());
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  EXPECT_EQ(streamed.content_type, "text/event-stream");
  const std::vector<json> events = Events(streamed.body);
  ASSERT_GE(events.size(), 2u) << streamed.body;
  EXPECT_EQ(events.back(), json("[DONE]"));
  std::string text;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json& e = events[i];
    if (e.is_object() && e.contains("choices") && !e.at("choices").empty()) {
      text += e.at("choices").at(0).value("text", "");
    }
  }
  EXPECT_EQ(text, whole.Json()["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(CallTls(http_port_, dir + "/ca.pem", http::verb::get, "/health", "").status, 200);
  // Plaintext HTTP on the TLS port, and a client trusting another CA: no answer.
  EXPECT_EQ(Post(http_port_, "/v1/completions", request).status, 0);
  EXPECT_EQ(CallTls(http_port_, other + "/ca.pem", http::verb::get, "/health", "").status, 0);
  // The server is still there for a client that does it right.
  EXPECT_EQ(CallTls(http_port_, dir + "/ca.pem", http::verb::get, "/health", "").status, 200);
}

// --tls-client-ca: the HTTP port, like the gRPC port, answers only clients whose certificate
// that CA signed (mTLS); one without a certificate or with another CA's gets no answer.
TEST_F(OpenAiHttp, TheHttpPortRequiresClientCertificatesWithTlsClientCa) {
  const std::string dir = testing::MakeCertificates("http_mtls");
  const std::string other = testing::MakeCertificates("http_mtls_other");
  Start({"--tls-cert=" + dir + "/service.pem", "--tls-key=" + dir + "/service.key",
         "--tls-client-ca=" + dir + "/ca.pem"});
  const std::string ca = dir + "/ca.pem";
  const json request = {{"prompt", {1, 2, 3, 4}}, {"max_tokens", 3}, {"temperature", 0}};
  const Reply ok =
      CallTls(http_port_, ca, http::verb::post, "/v1/completions", request.dump(), dir);
  ASSERT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(ok.Json()["usage"]["completion_tokens"], 3) << ok.body;
  EXPECT_EQ(CallTls(http_port_, ca, http::verb::get, "/health", "").status, 0) << "no certificate";
  EXPECT_EQ(CallTls(http_port_, ca, http::verb::get, "/health", "", other).status, 0)
      << "a certificate of another CA";
  EXPECT_EQ(CallTls(http_port_, ca, http::verb::get, "/health", "", dir).status, 200);
}

TEST_F(OpenAiHttp, NChoicesEqualGrpcRequestsWithConsecutiveSeeds) {
  Start();
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5};
  std::vector<std::vector<float>> want;
  for (uint64_t seed : {40, 41, 42}) {
    v1::GenerateRequest g;
    testing::FillTokenRequest(g, prompt, 8, 1.0f, seed);
    g.mutable_sampling()->set_logprobs(0);
    want.push_back(Grpc(grpc_port_, g).logprobs);
  }
  ASSERT_NE(want[0], want[1]) << "different seeds should sample differently";
  // As FillTokenRequest: top-k 30, EOS ignored.
  const json request = {{"prompt", prompt}, {"max_tokens", 8},    {"temperature", 1.0},
                        {"top_k", 30},      {"ignore_eos", true}, {"seed", 40},
                        {"n", 3},           {"logprobs", 0}};
  const Reply whole = Post(http_port_, "/v1/completions", request);
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json w = whole.Json();
  ASSERT_EQ(w["choices"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(w["choices"][i]["index"], i);
    EXPECT_EQ(w["choices"][i]["logprobs"]["token_logprobs"].get<std::vector<float>>(), want[i]);
  }
  EXPECT_EQ(w["usage"]["completion_tokens"], 24);
  EXPECT_EQ(w["usage"]["prompt_tokens"], 5);

  json streamed = request;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  const Reply s = Post(http_port_, "/v1/completions", streamed);
  ASSERT_EQ(s.status, 200) << s.body;
  const std::vector<json> events = Events(s.body);
  EXPECT_EQ(StreamedLogprobs(events, 3), want);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events[events.size() - 2]["usage"]["completion_tokens"], 24);
}

// OpenAI's batch of prompts: each choice equals the gRPC API's answer to its prompt alone (prompt
// p's choice i drawn with seed + i), whole and streamed; usage counts every prompt once. A batch
// with a prompt the server refuses is refused whole, streamed or not, and the server goes on.
TEST_F(OpenAiHttp, ABatchOfPromptsEqualsOneRequestPerPrompt) {
  Start();
  const std::vector<std::vector<int32_t>> prompts = {
      {3, 1, 4, 1, 5}, {2, 7, 1}, {8, 8, 2, 6, 4, 3}};
  std::vector<std::vector<float>> want;  // by choice: prompt x 2 + i
  for (const std::vector<int32_t>& prompt : prompts) {
    for (uint64_t seed : {40, 41}) {
      v1::GenerateRequest g;
      testing::FillTokenRequest(g, prompt, 6, 1.0f, seed);
      g.mutable_sampling()->set_logprobs(0);
      want.push_back(Grpc(grpc_port_, g).logprobs);
      ASSERT_EQ(want.back().size(), 6u);
    }
  }
  ASSERT_NE(want[0], want[2]) << "different prompts should sample differently";
  const json request = {{"prompt", prompts},
                        {"max_tokens", 6},
                        {"temperature", 1.0},
                        {"top_k", 30},
                        {"ignore_eos", true},
                        {"seed", 40},
                        {"n", 2},
                        {"logprobs", 0}};
  const Reply whole = Post(http_port_, "/v1/completions", request);
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json w = whole.Json();
  ASSERT_EQ(w["choices"].size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(w["choices"][i]["index"], i);
    EXPECT_EQ(w["choices"][i]["logprobs"]["token_logprobs"].get<std::vector<float>>(), want[i])
        << "choice " << i;
  }
  EXPECT_EQ(w["usage"]["prompt_tokens"], 14);
  EXPECT_EQ(w["usage"]["completion_tokens"], 36);

  json streamed = request;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  const Reply s = Post(http_port_, "/v1/completions", streamed);
  ASSERT_EQ(s.status, 200) << s.body;
  const std::vector<json> events = Events(s.body);
  for (const json& e : events) {
    if (e.is_object()) {
      EXPECT_EQ(e["id"], events[0]["id"]);
    }
  }
  EXPECT_EQ(StreamedLogprobs(events, 6), want);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events[events.size() - 2]["usage"]["prompt_tokens"], 14);
  EXPECT_EQ(events[events.size() - 2]["usage"]["completion_tokens"], 36);

  // The second prompt has a token id outside the vocabulary: the gRPC API refuses it.
  for (bool stream : {false, true}) {
    const Reply bad =
        Post(http_port_, "/v1/completions",
             {{"prompt", {{1, 2}, {1, 999999}, {3}}}, {"max_tokens", 4}, {"stream", stream}});
    EXPECT_EQ(bad.status, 400) << bad.body;
    EXPECT_TRUE(bad.Json().contains("error")) << bad.body;
  }
  EXPECT_EQ(Post(http_port_, "/v1/completions", {{"prompt", {{1, 2}, {3}}}, {"max_tokens", 2}})
                .Json()["choices"]
                .size(),
            2u);
}

TEST_F(OpenAiHttp, ModelsHealthAndErrorsInOpenAisShape) {
  Start();
  const Reply health = Call(http_port_, http::verb::get, "/health", "");
  EXPECT_EQ(health.status, 200) << health.body;
  const Reply models = Call(http_port_, http::verb::get, "/v1/models", "");
  ASSERT_EQ(models.status, 200);
  EXPECT_EQ(models.Json()["data"][0]["id"], "llama31_gqa");

  auto expect_error = [&](const Reply& r, int status, const std::string& param) {
    EXPECT_EQ(r.status, status) << r.body;
    const json j = r.Json();
    ASSERT_TRUE(j.contains("error")) << r.body;
    EXPECT_FALSE(j["error"]["message"].get<std::string>().empty());
    if (!param.empty()) {
      EXPECT_EQ(j["error"]["param"], param) << r.body;
    }
  };
  expect_error(Call(http_port_, http::verb::post, "/v1/completions", "{not json"), 400, "");
  expect_error(Post(http_port_, "/v1/completions", {{"prompt", {1, 2}}, {"n", 17}}), 400, "n");
  expect_error(Post(http_port_, "/v1/completions", {{"prompt", {1, 2}}, {"best_of", 2}}), 400,
               "best_of");
  expect_error(Post(http_port_, "/v1/completions", {{"prompt", {1, 2}}, {"temperature", 7}}), 400,
               "temperature");
  expect_error(Post(http_port_, "/v1/completions", {{"max_tokens", 3}}), 400, "prompt");
  expect_error(Post(http_port_, "/v1/chat/completions", {{"messages", json::array()}}), 400,
               "messages");
  expect_error(Post(http_port_, "/v1/completions", {{"prompt", {1, 2}}, {"model", "gpt-4"}}), 404,
               "model");
  // Refused by the gRPC API behind it, with its message (a token id outside the vocabulary).
  expect_error(Post(http_port_, "/v1/completions", {{"prompt", {1, 999999}}}), 400, "");
  // JSON mode needs each token's text: the fixture has none (FAILED_PRECONDITION); a schema is
  // not supported.
  expect_error(Post(http_port_, "/v1/completions",
                    {{"prompt", {1, 2}}, {"response_format", {{"type", "json_object"}}}}),
               400, "");
  expect_error(Post(http_port_, "/v1/completions",
                    {{"prompt", {1, 2}}, {"response_format", {{"type", "json_schema"}}}}),
               400, "response_format");
  // The fixture has no tokenizer: text prompts are the gRPC API's INVALID_ARGUMENT.
  expect_error(Post(http_port_, "/v1/completions", {{"prompt", "hello"}}), 400, "");
  // A content part whose `type` is a number: it ended the process (an exception in the parse).
  expect_error(Call(http_port_, http::verb::post, "/v1/chat/completions",
                    R"({"messages": [{"role": "user", "content": [{"type": 9, "text": "x"}]}]})"),
               400, "messages[0].content");
  expect_error(Call(http_port_, http::verb::get, "/v1/nothing", ""), 404, "");
  expect_error(Call(http_port_, http::verb::get, "/v1/completions", ""), 405, "");
  // Larger than 4x the gRPC request limit (the default 1 MiB): 413 before any parsing.
  expect_error(Call(http_port_, http::verb::post, "/v1/completions", std::string(5 << 20, ' ')),
               413, "");
  // The server still serves.
  EXPECT_EQ(Post(http_port_, "/v1/completions", {{"prompt", {1, 2}}, {"max_tokens", 2}}).status,
            200);
}

// SmolLM2 (scripts/setup.sh fetches it): slow enough on a CPU that a long generation is still
// running when the test acts on it.
TEST_F(OpenAiHttp, KeysAndAFullServerAnswer401And429WithRetryAfter) {
  const std::string smollm2 = testing::SmolLm2Path();
  IG_REQUIRE_FILE(smollm2, "SmolLM2 GGUF (scripts/setup.sh fetches it)");
  const std::string keys = ::testing::TempDir() + "/openai_http_keys.txt";
  std::ofstream(keys) << "sk-test-one\n";
  Start({"--api-keys-file=" + keys, "--max-streams=1", "--max-queued=0"}, smollm2);
  const json request = {{"prompt", {1, 2, 3}}, {"max_tokens", 4}};
  const Reply none = Post(http_port_, "/v1/completions", request);
  EXPECT_EQ(none.status, 401) << none.body;
  EXPECT_EQ(none.Json()["error"]["type"], "authentication_error");
  EXPECT_EQ(Post(http_port_, "/v1/completions", request, "Bearer sk-wrong").status, 401);
  EXPECT_EQ(Post(http_port_, "/v1/completions", request, "bearer sk-test-one").status, 200);
  // One long stream (seconds) holds the only slot; the next request is 429 with Retry-After.
  Reply held;
  std::thread holder([&] {
    held = Post(http_port_, "/v1/completions",
                {{"prompt", {1, 2, 3}}, {"max_tokens", 120}, {"ignore_eos", true}},
                "Bearer sk-test-one");
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const Reply busy = Post(http_port_, "/v1/completions", request, "Bearer sk-test-one");
  holder.join();
  EXPECT_EQ(held.status, 200) << held.body;
  EXPECT_EQ(busy.status, 429) << busy.body;
  EXPECT_FALSE(busy.retry_after.empty());
  EXPECT_EQ(busy.Json()["error"]["type"], "rate_limit_error");
}

// OpenAI's JSON mode on SmolLM2: the answer is one JSON object, greedy or sampled, whole or
// streamed, and it ends when the object closes (finish_reason "stop"); the same greedy request
// without it is not JSON (this model fences its JSON in markdown).
TEST_F(OpenAiHttp, JsonModeAnswersOneObject) {
  const std::string smollm2 = testing::SmolLm2Path();
  IG_REQUIRE_FILE(smollm2, "SmolLM2 GGUF (scripts/setup.sh fetches it)");
  Start({}, smollm2);
  const json messages = {
      {{"role", "user"}, {"content", "Describe a cat as JSON with fields name, age and color."}}};
  const json request = {{"messages", messages},
                        {"max_tokens", 150},
                        {"temperature", 0},
                        {"response_format", {{"type", "json_object"}}}};
  const Reply greedy = Post(http_port_, "/v1/chat/completions", request);
  ASSERT_EQ(greedy.status, 200) << greedy.body;
  const json g = greedy.Json();
  const json& choice = g["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "stop") << greedy.body;
  const std::string text = choice["message"]["content"];
  EXPECT_TRUE(json::parse(text, nullptr, false).is_object()) << text;

  json plain = request;
  plain.erase("response_format");
  const Reply free = Post(http_port_, "/v1/chat/completions", plain);
  ASSERT_EQ(free.status, 200) << free.body;
  const std::string free_text = free.Json()["choices"][0]["message"]["content"];
  EXPECT_TRUE(json::parse(free_text, nullptr, false).is_discarded()) << free_text;

  json sampled = request;
  sampled["temperature"] = 1.0;
  sampled["seed"] = 11;
  sampled["n"] = 4;
  const Reply four = Post(http_port_, "/v1/chat/completions", sampled);
  ASSERT_EQ(four.status, 200) << four.body;
  int whole = 0;
  const json samples = four.Json();
  for (const json& c : samples["choices"]) {
    const std::string t = c["message"]["content"];
    if (c["finish_reason"] == "stop") {
      EXPECT_TRUE(json::parse(t, nullptr, false).is_object()) << t;
      ++whole;
    }
  }
  EXPECT_GE(whole, 2) << four.body;

  json streamed = request;
  streamed["stream"] = true;
  const Reply s = Post(http_port_, "/v1/chat/completions", streamed);
  ASSERT_EQ(s.status, 200) << s.body;
  std::string joined, finish;
  for (const json& e : Events(s.body)) {
    if (!e.is_object() || e["choices"].empty()) continue;
    const json& c = e["choices"][0];
    if (c["delta"].contains("content")) joined += c["delta"]["content"].get<std::string>();
    if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
  }
  EXPECT_EQ(joined, text);
  EXPECT_EQ(finish, "stop");
}

TEST_F(OpenAiHttp, AClientThatHangsUpEndsItsGeneration) {
  const std::string smollm2 = testing::SmolLm2Path();
  IG_REQUIRE_FILE(smollm2, "SmolLM2 GGUF (scripts/setup.sh fetches it)");
  Start({}, smollm2);
  auto stub = v1::Generation::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port_),
                                                          grpc::InsecureChannelCredentials()));
  auto streams = [&] {
    grpc::ClientContext ctx;
    v1::ModelInfo info;
    EXPECT_TRUE(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
    return info.streams();
  };
  for (bool stream : {true, false}) {
    net::io_context io;
    tcp::socket socket(io);
    socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), http_port_));
    http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
    req.set(http::field::host, "127.0.0.1");
    // Seconds of generation on this CPU: it runs until cancelled.
    req.body() =
        json{{"prompt", {1, 2, 3}}, {"max_tokens", 1000}, {"ignore_eos", true}, {"stream", stream}}
            .dump();
    req.prepare_payload();
    http::write(socket, req);
    int running = 0;
    for (int i = 0; i < 500 && running == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      running = streams();
    }
    ASSERT_EQ(running, 1) << "stream " << stream;
    socket.close();
    // 1000 tokens take tens of seconds here; a cancelled one ends within a step or two.
    for (int i = 0; i < 300 && running != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      running = streams();
    }
    EXPECT_EQ(running, 0) << "the generation of a client that left still runs (stream " << stream
                          << ")";
  }
}

// A connection that sends no whole request (idle keep-alive, or a slow sender) is closed after
// --http-idle-timeout-seconds: it cannot hold one of the connection threads forever.
TEST_F(OpenAiHttp, IdleAndSlowConnectionsAreClosed) {
  Start({"--http-idle-timeout-seconds=1"});
  net::io_context io;
  tcp::socket idle(io), slow(io);
  idle.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), http_port_));
  slow.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), http_port_));
  net::write(slow, net::buffer(std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\n")));
  for (tcp::socket* s : {&idle, &slow}) {
    // The server closes it: a read returns end of file (or a reset) within a few seconds.
    pollfd p{s->native_handle(), POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 10000), 1) << "the server kept the connection open";
    char c;
    EXPECT_LE(::recv(s->native_handle(), &c, 1, 0), 0);
  }
  // A connection in use is not cut: a request after 0.5 s of idleness is answered.
  tcp::socket fresh(io);
  fresh.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), http_port_));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  http::request<http::string_body> req{http::verb::get, "/health", 11};
  req.set(http::field::host, "127.0.0.1");
  http::write(fresh, req);
  beast::flat_buffer buffer;
  http::response<http::string_body> res;
  http::read(fresh, buffer, res);
  EXPECT_EQ(res.result_int(), 200);
}

// `infinigen load --api openai`: 16 streams of streamed completions over keep-alive connections
// for 20 s, zero errors, every token counted.
TEST_F(OpenAiHttp, BoundedLoadOverHttpHasNoErrors) {
  Start();
  const std::string out = ::testing::TempDir() + "/openai_load.json";
  const std::string cmd = testing::BinaryPath("infinigen") +
                          " load --api openai --server 127.0.0.1:" + std::to_string(http_port_) +
                          " --streams 16 --seconds 20 --max-tokens 16 --temperature 0.7 --json " +
                          out + " > " + out + ".log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(out);
  const json j = json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["errors"].get<int>(), 0) << j.dump();
  EXPECT_GT(j["requests_ok"].get<int>(), 16) << j.dump();
  EXPECT_EQ(j["tokens"].get<int>(), 16 * j["requests_ok"].get<int>()) << j.dump();
}

}  // namespace
}  // namespace infinigen
