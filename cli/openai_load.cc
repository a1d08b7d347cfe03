#include "cli/openai_load.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"

namespace infinigen::cli {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

struct Outcome {
  bool ok = false;
  std::string error;  // when not ok: "<HTTP status or transport> <message>"
  int64_t tokens = 0;
};

// One streamed completion on `socket` (reconnected by the caller when it fails). Token events are
// the chunks whose choice carries text or a finish reason; the usage chunk counts the tokens.
Outcome Complete(tcp::socket& socket, const std::string& host, const std::string& api_key,
                 const std::string& body, std::vector<double>& ttft, std::vector<double>& gaps) {
  Outcome out;
  http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
  req.set(http::field::host, host);
  req.set(http::field::content_type, "application/json");
  if (!api_key.empty()) req.set(http::field::authorization, "Bearer " + api_key);
  req.keep_alive(true);
  req.body() = body;
  req.prepare_payload();
  beast::error_code ec;
  const absl::Time start = absl::Now();
  http::write(socket, req, ec);
  if (ec) return {false, "transport " + ec.message()};
  beast::flat_buffer buffer;
  http::response_parser<http::buffer_body> parser;
  parser.body_limit(std::numeric_limits<std::uint64_t>::max());
  http::read_header(socket, buffer, parser, ec);
  if (ec) return {false, "transport " + ec.message()};
  const int status = parser.get().result_int();
  std::string pending, whole;
  absl::Time prev = start;
  bool first = true;
  char chunk[16384];
  while (!parser.is_done()) {
    parser.get().body().data = chunk;
    parser.get().body().size = sizeof(chunk);
    http::read_some(socket, buffer, parser, ec);
    if (ec == http::error::need_buffer) ec = {};
    if (ec) return {false, "transport " + ec.message()};
    const size_t n = sizeof(chunk) - parser.get().body().size;
    if (status != 200) {
      whole.append(chunk, n);
      continue;
    }
    pending.append(chunk, n);
    size_t end;
    while ((end = pending.find("\n\n")) != std::string::npos) {
      const std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0 || event == "data: [DONE]") continue;
      const nlohmann::json j = nlohmann::json::parse(event.substr(6), nullptr, false);
      if (j.is_discarded()) return {false, "malformed event " + event.substr(0, 60)};
      if (j.contains("error")) {
        return {false, "stream " + j["error"].value("message", std::string()).substr(0, 80)};
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        out.tokens = j["usage"].value("completion_tokens", int64_t{0});
      }
      if (!j.contains("choices") || j["choices"].empty()) continue;
      const absl::Time now = absl::Now();
      (first ? ttft : gaps).push_back(absl::ToDoubleSeconds(now - prev));
      first = false;
      prev = now;
    }
  }
  if (status != 200) {
    const nlohmann::json j = nlohmann::json::parse(whole, nullptr, false);
    const std::string message =
        j.is_object() && j.contains("error") ? j["error"].value("message", whole) : whole;
    return {false, absl::StrCat(status, " ", message.substr(0, 80))};
  }
  out.ok = true;
  if (!parser.get().keep_alive()) socket.close(ec);
  return out;
}

}  // namespace

void DriveOpenAi(const std::string& address, const std::string& api_key, const LoadSpec& spec,
                 int stream, Samples& out) {
  std::mt19937_64 rng(static_cast<uint64_t>(stream) * 7919 + 1);
  std::vector<double> ttft, gaps;
  int64_t ok = 0, tokens = 0;
  std::map<std::string, int64_t> errors;
  std::vector<std::string> hp = absl::StrSplit(address, absl::MaxSplits(':', 1));
  int port = 0;
  net::io_context io;
  tcp::socket socket(io);
  beast::error_code ec;
  tcp::endpoint endpoint;
  if (hp.size() == 2 && absl::SimpleAtoi(hp[1], &port)) {
    const auto ip = net::ip::make_address(hp[0] == "localhost" ? "127.0.0.1" : hp[0], ec);
    endpoint = tcp::endpoint(ip, static_cast<uint16_t>(port));
  } else {
    ec = net::error::invalid_argument;
  }
  while (absl::Now() < spec.end) {
    if (ec) {
      ++errors["address " + address + ": " + ec.message()];
      break;
    }
    if (!socket.is_open()) {
      socket.connect(endpoint, ec);
      // A request's header and body may leave in two segments: without this the body waits for
      // the server's delayed ACK of the header (40 ms).
      if (!ec) socket.set_option(tcp::no_delay(true), ec);
      if (ec) {
        ++errors["transport connect: " + ec.message()];
        ec = {};
        socket = tcp::socket(io);
        absl::SleepFor(absl::Milliseconds(100));
        continue;
      }
    }
    nlohmann::json body = {{"max_tokens", spec.max_tokens},
                           {"temperature", spec.temperature},
                           {"seed", static_cast<int64_t>(rng() >> 1)},
                           {"ignore_eos", true},
                           {"stream", true},
                           {"stream_options", {{"include_usage", true}}}};
    if (!spec.text.empty()) {
      body["prompt"] = spec.text;
    } else {
      std::vector<int32_t> ids;
      for (int64_t i = 0; i < spec.prompt_tokens; ++i) {
        ids.push_back(static_cast<int32_t>(1 + rng() % (spec.vocab - 1)));
      }
      body["prompt"] = ids;
    }
    const Outcome o = Complete(socket, hp[0], api_key, body.dump(), ttft, gaps);
    if (o.ok) {
      ++ok;
      tokens += o.tokens;
    } else {
      ++errors[o.error];
      beast::error_code ignored;
      socket.close(ignored);
      socket = tcp::socket(io);
    }
  }
  out.Merge(ok, tokens, errors, ttft, gaps);
}

}  // namespace infinigen::cli
