#include <fstream>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/sampling_flags.h"
#include "gpu_worker/infinigen/eval.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "nlohmann/json.hpp"

namespace infinigen::cli {

std::string DefaultBookPath();
absl::StatusOr<std::string> ReadTextFile(const std::string& path, const char* what);

namespace {

absl::StatusOr<std::vector<double>> ParseNumbers(const std::string& text, const char* flag) {
  std::vector<double> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    double v;
    if (!absl::SimpleAtod(part, &v)) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", part, "' is not a number"));
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace

int RunEval(int argc, char** argv) {
  std::string model_path, sidecar_path, corpus_path, haystack_path,
      policies = "full,infinigen", budgets = "0.2", alphas = "10", passkeys, json_out,
      eviction = "counter", speculation = "prev";
  int64_t context = 2048, eval_tokens = 256, windows = 1, generate = 0, dense_layers = 2, sink = 0,
          recent = 0;
  double kv_pool = 0.0;
  bool through_store = false;
  bool no_recall = false;
  BackendSpec backend;
  FlagSet flags("infinigen eval", "--model PATH --corpus FILE [flags]",
                "Measures selection policies against dense attention: perplexity of each "
                "window's last --eval-tokens tokens decoded one by one with the policy, KV rows "
                "read, attention-mass recall vs the oracle, greedy agreement and passkey "
                "retrieval. Prints a markdown table; --json writes the numbers.");
  flags.String("model", &model_path, "model folder or .gguf file");
  flags.String("sidecar", &sidecar_path, "InfiniGen sidecar (default: next to the model)");
  flags.String("corpus", &corpus_path, "text for perplexity and greedy prompts");
  flags.String("haystack", &haystack_path, "text that hides the passkey (default: Emma)");
  flags.String("policies", &policies, "comma-separated: full, infinigen, h2o, window, oracle");
  flags.String("budgets", &budgets, "comma-separated budget fractions for sparse policies");
  flags.String("alphas", &alphas, "comma-separated InfiniGen logit margins");
  flags.Int("context", &context, "tokens per window");
  flags.Int("eval-tokens", &eval_tokens, "tokens decoded (and scored) per window");
  flags.Int("windows", &windows, "consecutive corpus windows");
  flags.Int("generate-tokens", &generate, "greedy agreement length (0 = skip)");
  flags.String("passkey-depths", &passkeys, "comma-separated depths in [0, 1] (empty = skip)");
  flags.Int("dense-layers", &dense_layers, "layers that always attend densely");
  flags.Int("sink-tokens", &sink, "always-kept first tokens (InfiniGen; window default 4)");
  flags.Int("recent-tokens", &recent, "always-kept latest tokens (InfiniGen)");
  flags.String("speculation", &speculation,
               "InfiniGen speculation input: prev (layer i-1's norm), this (layer i's norm), or "
               "actual (layer i's own query: an analysis upper bound)");
  flags.Float("kv-pool", &kv_pool, "KV pool capacity as a fraction of each sequence (0 = none)");
  flags.String("eviction", &eviction, "KV pool eviction: counter, fifo, lru");
  flags.Bool("kv-store", &through_store,
             "decode over a KV store in this process, as the worker does (StoreKvCache)");
  flags.Bool("no-recall", &no_recall, "skip the attention-mass recall measurement (faster)");
  flags.String("json", &json_out, "also write the results to this JSON file");
  RegisterBackendFlags(flags, backend);
  auto parsed = flags.Parse(argc, argv);
  if (!parsed.ok()) return ReportError("eval", parsed.status());
  if (!*parsed) return 0;
  auto fail = [](const absl::Status& st) { return ReportError("eval", st); };
  if (model_path.empty() || corpus_path.empty()) {
    return fail(absl::InvalidArgumentError("--model and --corpus are required"));
  }
  auto budget_list = ParseNumbers(budgets, "budgets");
  auto alpha_list = ParseNumbers(alphas, "alphas");
  auto depth_list = ParseNumbers(passkeys, "passkey-depths");
  for (auto* l : {&budget_list, &alpha_list, &depth_list}) {
    if (!l->ok()) return fail(l->status());
  }
  EvalOptions options;
  options.context = context;
  options.eval_tokens = eval_tokens;
  options.windows = windows;
  options.generate_tokens = generate;
  options.passkey_depths = *depth_list;
  options.measure_recall = !no_recall;
  options.through_store = through_store;
  if (kv_pool > 0) {
    auto ev = ParseEvictionPolicy(eviction);
    if (!ev.ok()) return fail(ev.status());
    options.use_kv_pool = true;
    options.kv_pool.capacity_fraction = kv_pool;
    options.kv_pool.eviction = *ev;
  }
  auto loaded = LoadModel(model_path, backend);
  if (!loaded.ok()) return fail(loaded.status());
  auto tokenizer = LoadTokenizer(*loaded->checkpoint);
  if (!tokenizer.ok()) return fail(tokenizer.status());
  auto corpus_text = ReadTextFile(corpus_path, "corpus");
  if (!corpus_text.ok()) return fail(corpus_text.status());
  const auto corpus = (*tokenizer)->Encode(*corpus_text);
  std::vector<int32_t> haystack;
  if (!depth_list->empty()) {
    auto text =
        ReadTextFile(haystack_path.empty()
                         ? absl::StrReplaceAll(DefaultBookPath(), {{"pride_and_prejudice", "emma"}})
                         : haystack_path,
                     "haystack text");
    if (!text.ok()) return fail(text.status());
    haystack = (*tokenizer)->Encode(*text);
  }
  std::unique_ptr<InfinigenSidecar> sidecar;
  if (policies.find("infinigen") != std::string::npos) {
    auto s = ReadSidecar(sidecar_path.empty() ? DefaultSidecarPath(model_path) : sidecar_path,
                         *loaded->checkpoint);
    if (!s.ok()) return fail(s.status());
    sidecar = std::make_unique<InfinigenSidecar>(std::move(*s));
    if (auto st = AttachSidecar(*loaded->model, *loaded->checkpoint, *sidecar); !st.ok()) {
      return fail(st);
    }
  }
  Model& model = *loaded->model;
  std::vector<int32_t> reference;
  if (generate > 0) {
    auto r = DenseGreedy(model, corpus, options);
    if (!r.ok()) return fail(r.status());
    reference = std::move(*r);
  }

  nlohmann::json rows = nlohmann::json::array();
  double full_ppl = 0;
  std::cout << "| policy | budget | alpha | perplexity | vs full | KV read (all layers) | KV read "
               "(sparse layers) | KV moved (all layers) | KV moved (sparse layers) | mass recall | "
               "greedy agreement | identical prefix | passkey | seconds |\n"
               "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (absl::string_view name : absl::StrSplit(policies, ',', absl::SkipWhitespace())) {
    const bool sparse = name != "full";
    for (double budget : sparse ? *budget_list : std::vector<double>{1.0}) {
      for (double alpha : name == "infinigen" ? *alpha_list : std::vector<double>{0.0}) {
        SelectionConfig config;
        auto kind = ParsePolicyKind(name);
        if (!kind.ok()) return fail(kind.status());
        config.policy = *kind;
        config.dense_layers = static_cast<int>(dense_layers);
        config.budget_fraction = budget;
        if (alpha > 0) config.alpha = alpha;
        config.sink_tokens = sink;
        config.recent_tokens = recent;
        config.speculation = speculation == "this"     ? SpeculationInput::kThisLayerNorm
                             : speculation == "actual" ? SpeculationInput::kActualQuery
                                                       : SpeculationInput::kPreviousNorm;
        auto policy = MakeSelectionPolicy(config, model.config(), sidecar.get());
        if (!policy.ok()) return fail(policy.status());
        auto r =
            Evaluate(model, corpus, haystack, tokenizer->get(), sparse ? policy->get() : nullptr,
                     config.dense_layers, options, reference);
        if (!r.ok()) return fail(r.status());
        if (!sparse) full_ppl = r->perplexity;
        const double ratio = full_ppl > 0 ? r->perplexity / full_ppl : 0.0;
        // "-" where a column was not measured in this run.
        auto measured = [](bool m, std::string v) { return m ? v : std::string("-"); };
        std::cout
            << absl::StrFormat(
                   "| %s | %s | %s | %.3f | %s | %.3f | %.3f | %.3f | %.3f | %s | %s | %s | %s | "
                   "%.0f |\n",
                   name, sparse ? absl::StrFormat("%.2f", budget) : "-",
                   alpha > 0 ? absl::StrFormat("%.1f", alpha) : "-", r->perplexity,
                   full_ppl > 0 ? absl::StrFormat("%.4fx", ratio) : "-", r->meter.fraction_read(),
                   r->meter.sparse_fraction_read(), r->meter.fraction_moved(),
                   r->meter.sparse_fraction_moved(),
                   measured(options.measure_recall, absl::StrFormat("%.3f", r->meter.recall())),
                   measured(generate > 0, absl::StrFormat("%.3f", r->greedy_agreement)),
                   measured(generate > 0, absl::StrCat(r->greedy_identical_prefix)),
                   measured(r->passkey_total > 0,
                            absl::StrFormat("%d/%d", r->passkey_found, r->passkey_total)),
                   r->seconds)
            << std::flush;
        rows.push_back({{"policy", std::string(name)},
                        {"budget", budget},
                        {"alpha", alpha},
                        {"perplexity", r->perplexity},
                        {"perplexity_vs_full", ratio},
                        {"kv_read_fraction", r->meter.fraction_read()},
                        {"kv_read_fraction_sparse_layers", r->meter.sparse_fraction_read()},
                        {"kv_moved_fraction", r->meter.fraction_moved()},
                        {"kv_moved_fraction_sparse_layers", r->meter.sparse_fraction_moved()},
                        {"prefetch_misses", r->meter.prefetch_misses},
                        {"attention_mass_recall", r->meter.recall()},
                        {"greedy_agreement", r->greedy_agreement},
                        {"greedy_identical_prefix", r->greedy_identical_prefix},
                        {"passkey_found", r->passkey_found},
                        {"passkey_total", r->passkey_total},
                        {"scored_tokens", r->scored_tokens},
                        {"seconds", r->seconds}});
      }
    }
  }
  if (!json_out.empty()) {
    nlohmann::json doc = {{"model", model_path},
                          {"corpus", corpus_path},
                          {"context", context},
                          {"eval_tokens", eval_tokens},
                          {"windows", windows},
                          {"dense_layers", dense_layers},
                          {"generate_tokens", generate},
                          {"passkey_depths", *depth_list},
                          {"speculation", speculation},
                          {"sink_tokens", sink},
                          {"recent_tokens", recent},
                          {"kv_pool", kv_pool},
                          {"kv_store", through_store},
                          {"method",
                           "each window prefilled densely up to its last eval_tokens "
                           "tokens, which are decoded one at a time with the policy"},
                          {"results", rows}};
    if (sidecar != nullptr) {
      doc["sidecar"] = {
          {"path", sidecar_path.empty() ? DefaultSidecarPath(model_path) : sidecar_path},
          {"ratio", sidecar->ratio},
          {"partial_dim", sidecar->partial_dim},
          {"skewed", sidecar->skewed},
          {"channel_rule", sidecar->channel_rule},
          {"calibration_tokens", sidecar->calibration_tokens}};
    }
    std::ofstream(json_out) << doc.dump(2) << "\n";
  }
  return 0;
}

}  // namespace infinigen::cli
