// The `infinigen` binary as a user runs it: help, one-line errors with exit code 2, and the
// logits command writing the engine's logits to a .npy file.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/npy.h"
#include "nlohmann/json.hpp"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;

struct CommandResult {
  int exit_code;
  std::string out, err;
};

std::string Slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// `env`: VAR=value assignments for the command.
CommandResult Infinigen(const std::string& args, const std::string& env = "") {
  // CTest runs these tests in parallel processes: every run gets its own output files.
  static int calls = 0;
  const std::string stem =
      (fs::temp_directory_path() /
       ("infinigen_cli_" + std::to_string(getpid()) + "_" + std::to_string(++calls)))
          .string();
  const std::string out = stem + ".out", err = stem + ".err";
  const std::string cmd = env + " " + testing::BinaryPath("infinigen") + " </dev/null " + args +
                          " >" + out + " 2>" + err;
  const int status = std::system(cmd.c_str());
  CommandResult result{WIFEXITED(status) ? WEXITSTATUS(status) : -1, Slurp(out), Slurp(err)};
  fs::remove(out);
  fs::remove(err);
  return result;
}

int Lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

TEST(Cli, HelpForEveryCommand) {
  CommandResult top = Infinigen("--help");
  EXPECT_EQ(top.exit_code, 0);
  EXPECT_NE(top.out.find("generate"), std::string::npos);
  for (const char* cmd : {"generate", "logits", "bench", "tokenize", "prepare", "eval"}) {
    CommandResult r = Infinigen(std::string(cmd) + " --help");
    EXPECT_EQ(r.exit_code, 0) << cmd;
    EXPECT_NE(r.out.find("--"), std::string::npos) << cmd;
  }
}

TEST(Cli, BadFlagsAndPathsAreOneLineErrorsWithExitCode2) {
  for (const std::string args :
       {"generate --bogus 1", "generate --model",
        "logits --model /no/such/model --token-ids 1 --out x.npy",
        "generate --model /no/such/model --prompt-ids 1,2", "generate --model . --prompt-ids a,b",
        "frobnicate", "generate --max-tokens many", "tokenize --tokenizer /nope --text x",
        "tokenize --text x", "bench --model /nope"}) {
    CommandResult r = Infinigen(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    EXPECT_EQ(Lines(r.err), 1) << args << ": " << r.err;
  }
  CommandResult pin = Infinigen("bench --model " + testing::FixturePath("hf/llama32_tied") +
                                " --prompt-tokens 2 --gen-tokens 1 --pin-threads sometimes");
  EXPECT_EQ(pin.exit_code, 2) << pin.err;
  EXPECT_NE(pin.err.find("--pin-threads must be auto, on or off"), std::string::npos) << pin.err;
  EXPECT_EQ(Lines(pin.err), 1) << pin.err;
}

// `bench --depth N` (llama-bench's -d) runs its tests after N tokens already in the cache, and
// says so; a depth the model's context cannot hold is refused in one line.
TEST(Cli, BenchAtDepth) {
  const std::string model = testing::FixturePath("hf/llama32_tied");  // context 256
  CommandResult r = Infinigen("bench --model " + model +
                              " --depth 200 --prompt-tokens 8 --gen-tokens 4 --repetitions 1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["depth"], 200);
  EXPECT_GT(j["prefill_tokens_per_s"].get<double>(), 0);
  EXPECT_GT(j["decode_tokens_per_s"].get<double>(), 0);
  CommandResult deep =
      Infinigen("bench --model " + model + " --depth 250 --prompt-tokens 8 --gen-tokens 0");
  EXPECT_EQ(deep.exit_code, 2) << deep.err;
  EXPECT_NE(deep.err.find("--depth plus the longer test (258 tokens) exceeds the model's "
                          "context of 256 tokens"),
            std::string::npos)
      << deep.err;
  EXPECT_EQ(Lines(deep.err), 1) << deep.err;
  CommandResult negative = Infinigen("bench --model " + model + " --depth -1");
  EXPECT_EQ(negative.exit_code, 2) << negative.err;
  EXPECT_NE(negative.err.find("and --depth must be >= 0"), std::string::npos) << negative.err;
}

#if INFINIGEN_TEST_HAVE_SERVICES
// `infinigen serve` takes the service binaries' flags as they spell them (underscores) as well as
// its own dashes, validates them with the binaries' checks (--check-flags: without loading the
// model), and refuses a value that does not fit its field instead of wrapping it.
TEST(Cli, ServeChecksItsFlagsAsTheServiceBinariesDo) {
  CommandResult ok = Infinigen(
      "serve --model /no/such/model --check_flags --max_new_tokens_limit=240 "
      "--max-streams-per-key=2 --requests_per_second_per_key=5 --http_max_connections=8 "
      "--max_sessions=4 --session-ttl-seconds=30");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"--max-new-tokens-limit=99999999999", "--max-new-tokens-limit"},
      {"--max_new_tokens_limit=240 --default_max_new_tokens=300", "default_max_new_tokens"},
      {"--max-streams-per-key=-1", "max_streams"},
      {"--max_sessions=-1", "max_sessions"},
      {"--max-prompt-tokens=-5", "max_prompt_tokens"},
  };
  for (const auto& [args, named] : refused) {
    CommandResult r = Infinigen("serve --model /no/such/model --check-flags " + args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    EXPECT_NE(r.err.find(named), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(Lines(r.err), 1) << args << ": " << r.err;
  }
}
#endif

TEST(Cli, CudaLibrariesLoadOnlyForTheCudaDevice) {
  // The CUDA backend is a plugin (gpu_worker/backend/cuda_plugin.h): a CPU run maps none of
  // CUDA's libraries (glibc's loader lists every library it opens under LD_DEBUG=files).
  const std::string model = testing::FixturePath("hf/llama32_tied");
  const std::string bench = "bench --model " + model + " --prompt-tokens 2 --gen-tokens 1 ";
  CommandResult cpu = Infinigen(bench, "LD_DEBUG=files");
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  EXPECT_NE(cpu.err.find("libopenblas"), std::string::npos) << "LD_DEBUG lists no libraries";
  EXPECT_EQ(cpu.err.find("libcublas"), std::string::npos);
  EXPECT_EQ(cpu.err.find("libcudart"), std::string::npos);

  // A missing plugin is a one-line error that names where it was looked for.
  CommandResult missing =
      Infinigen(bench + "--device cuda", "INFINIGEN_CUDA_BACKEND=/no/such/plugin.so");
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.err.find("no CUDA backend"), std::string::npos) << missing.err;
  EXPECT_NE(missing.err.find("/no/such/plugin.so"), std::string::npos) << missing.err;

  // Where this build made the plugin, --device cuda loads it (and CUDA's libraries): it runs on a
  // GPU machine and says there is no device elsewhere.
  if (!fs::exists(fs::path(testing::BinaryPath("infinigen")).parent_path() /
                  "libinfinigen_cuda.so")) {
    return;
  }
  CommandResult cuda = Infinigen(bench + "--device cuda", "LD_DEBUG=files");
  EXPECT_NE(cuda.err.find("libcublas"), std::string::npos);
  if (cuda.exit_code != 0) {
    EXPECT_NE(cuda.err.find("no CUDA device"), std::string::npos) << cuda.err;
  }
}

TEST(Cli, LogitsCommandWritesTheEnginesLogits) {
  const std::string dir = testing::FixturePath("hf/opt_preln");
  const std::string out =
      (fs::temp_directory_path() / (std::to_string(getpid()) + "_cli_logits.npy")).string();
  auto tokens = testing::NpyInts(dir + "/tokens.npy");
  std::string ids;
  for (int32_t t : tokens) ids += (ids.empty() ? "" : ",") + std::to_string(t);
  CommandResult r = Infinigen("logits --model " + dir + " --token-ids " + ids + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto got = ReadNpy(out);
  ASSERT_TRUE(got.ok()) << got.status();
  auto want = ReadNpy(dir + "/logits.npy");
  EXPECT_EQ(got->shape, want->shape);
  auto g = *got->AsFloat(), w = *want->AsFloat();
  for (size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(g[i], w[i], 1e-4) << i;
  fs::remove(out);
}

TEST(Cli, GenerateGreedyPrintsTheFixturesContinuation) {
  const std::string dir = testing::FixturePath("hf/llama32_tied");
  auto prompt = testing::NpyInts(dir + "/prompt.npy");
  auto want = testing::NpyInts(dir + "/greedy.npy");
  std::string ids, expect;
  for (int32_t t : prompt) ids += (ids.empty() ? "" : ",") + std::to_string(t);
  for (int32_t t : want) expect += (expect.empty() ? "[" : ",") + std::to_string(t);
  CommandResult r = Infinigen("generate --model " + dir + " --prompt-ids " + ids +
                              " --max-tokens 32 --ignore-eos --temperature 0 --ids");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, expect + "]\n");
}

std::string WriteTemp(const std::string& name, const std::string& content) {
  const std::string path =
      (fs::temp_directory_path() / (std::to_string(getpid()) + "_" + name)).string();
  std::ofstream(path) << content;
  return path;
}

TEST(Cli, TokenizeJsonlEncodesAndDecodes) {
  const std::string tok = testing::SharedTestdataPath("tokenizers/gpt2");
  IG_REQUIRE_FILE(tok, "GPT-2 tokenizer");
  const std::string in = WriteTemp("infinigen_tok_in.jsonl", "\"Hello world\"\n\" caf\\u00e9\"\n");
  CommandResult enc = Infinigen("tokenize --tokenizer " + tok + " --jsonl <" + in);
  // stdin is /dev/null unless the arguments redirect it.
  ASSERT_EQ(enc.exit_code, 0) << enc.err;
  EXPECT_EQ(enc.out, "[15496,995]\n[40304]\n");  // " café" is one GPT-2 token
  const std::string ids = WriteTemp("infinigen_tok_ids.jsonl", "[15496,995]\n[40304]\n");
  CommandResult dec = Infinigen("tokenize --tokenizer " + tok + " --jsonl --decode <" + ids);
  ASSERT_EQ(dec.exit_code, 0) << dec.err;
  EXPECT_EQ(dec.out, "\"Hello world\"\n\" caf\xC3\xA9\"\n");
  const std::string bad = WriteTemp("infinigen_tok_bad.jsonl", "[1,2]\nnot json\n");
  CommandResult err = Infinigen("tokenize --tokenizer " + tok + " --jsonl <" + bad);
  EXPECT_EQ(err.exit_code, 2);
  EXPECT_NE(err.err.find("line 1"), std::string::npos) << err.err;
}

// With the file's exact values (f32): the answer's first token is a near tie ("The" at -1.86
// nats against "L" at -1.96), which the block formats' 8-bit activations flip (q4_1 and q8 answer
// "L'Étoile, ..."; docs/model.md, "CPU weight formats").
TEST(Cli, GenerateStreamsTextForAChat) {
  const std::string model = testing::SmolLm2Path();
  IG_REQUIRE_FILE(model, "SmolLM2 GGUF");
  CommandResult r = Infinigen("generate --model " + model +
                              " --chat '[{\"role\": \"user\", \"content\": \"What is the "
                              "capital of France?\"}]' --max-tokens 12 --cpu-weights f32");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("Paris"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("(stop)"), std::string::npos) << r.err;  // ended at <|im_end|>
}

}  // namespace
}  // namespace infinigen

namespace infinigen {
namespace {

// prepare with its defaults (26 partial channels, product rule), then eval of every policy on a
// short WikiText window: the JSON has one row per policy, `full` reads everything, the sparse
// policies stay within their budget, and every column the flags asked for was measured.
TEST(Cli, PrepareThenEvalEveryPolicy) {
  const std::string model = testing::SmolLm2Path();
  IG_REQUIRE_FILE(model, "SmolLM2 GGUF");
  const std::string wiki = testing::SharedTestdataPath("corpora/wikitext-2/test.txt");
  IG_REQUIRE_FILE(wiki, "WikiText-2 test split");
  const std::string sidecar =
      (fs::temp_directory_path() / (std::to_string(getpid()) + "_cli.safetensors")).string();
  const std::string json =
      (fs::temp_directory_path() / (std::to_string(getpid()) + "_cli_eval.json")).string();
  CommandResult prep =
      Infinigen("prepare --model " + model + " --calibration " + wiki +
                " --calibration-tokens 96 --cpu-weights q8 --threads 1 --out " + sidecar);
  ASSERT_EQ(prep.exit_code, 0) << prep.err;
  EXPECT_NE(prep.out.find("26 of 64 channels"), std::string::npos) << prep.out;

  CommandResult eval =
      Infinigen("eval --model " + model + " --sidecar " + sidecar + " --corpus " + wiki +
                " --haystack " + wiki +
                " --context 160 --eval-tokens 16 --generate-tokens 8 --passkey-depths 0.5 "
                "--policies full,infinigen,h2o,window,oracle --budgets 0.25 --cpu-weights q8 "
                "--threads 1 --json " +
                json);
  ASSERT_EQ(eval.exit_code, 0) << eval.err;
  EXPECT_EQ(Lines(eval.out), 2 + 5) << eval.out;  // header, rule, one row per policy
  auto doc = nlohmann::json::parse(Slurp(json));
  ASSERT_EQ(doc["results"].size(), 5u);
  double full_ppl = 0;
  for (const auto& row : doc["results"]) {
    const std::string policy = row["policy"];
    const double ppl = row["perplexity"];
    EXPECT_TRUE(ppl > 1.0 && ppl < 1e4) << policy << " " << ppl;
    EXPECT_EQ(row["passkey_total"], 1) << policy;
    if (policy == "full") {
      full_ppl = ppl;
      EXPECT_EQ(row["kv_read_fraction"], 1.0);
      EXPECT_EQ(row["greedy_agreement"], 1.0);
    } else {
      EXPECT_LE(row["kv_read_fraction_sparse_layers"].get<double>(), 0.25 + 0.02) << policy;
      EXPECT_GT(row["kv_read_fraction"].get<double>(),
                row["kv_read_fraction_sparse_layers"].get<double>())
          << policy << ": the dense layers read everything";
      EXPECT_NEAR(row["perplexity_vs_full"].get<double>(), ppl / full_ppl, 1e-9) << policy;
    }
    const double recall = row["attention_mass_recall"];
    EXPECT_TRUE(recall > 0.0 && recall <= 1.0 + 1e-9) << policy;
  }
  fs::remove(sidecar);
  fs::remove(json);
}

}  // namespace
}  // namespace infinigen
