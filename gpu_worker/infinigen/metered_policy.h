// A policy wrapper for evaluation: counts the rows each decode step attends (read) and the rows
// a worker over the KV store would move for it (the prefetched candidates of Preselect, and the
// exact selection again when it left them: what DecodeStep does) against a full fetch, and
// measures how much of the true attention mass the selected rows hold compared with the
// oracle's top-k at the same k.
#pragma once

#include <memory>

#include "gpu_worker/kv/kv_selection.h"
#include "gpu_worker/model/config.h"

namespace infinigen {

struct SelectionMeter {
  int64_t rows_read = 0, rows_full = 0;                // every layer
  int64_t sparse_rows_read = 0, sparse_rows_full = 0;  // layers >= dense_layers
  int64_t rows_moved = 0, sparse_rows_moved = 0;       // candidates + misses, stored rows only
  int64_t prefetch_misses = 0;                         // steps whose selection left them
  double recall_sum = 0.0;                             // Σ mass(selected) / mass(oracle top-k)
  int64_t recall_steps = 0;                            // sparse layer-steps measured

  double fraction_read() const { return rows_full ? double(rows_read) / rows_full : 1.0; }
  double sparse_fraction_read() const {
    return sparse_rows_full ? double(sparse_rows_read) / sparse_rows_full : 1.0;
  }
  double recall() const { return recall_steps ? recall_sum / recall_steps : 1.0; }
  double fraction_moved() const { return rows_full ? double(rows_moved) / rows_full : 1.0; }
  double sparse_fraction_moved() const {
    return sparse_rows_full ? double(sparse_rows_moved) / sparse_rows_full : 1.0;
  }
};

class MeteredPolicy final : public KvSelectionPolicy {
 public:
  // `measure_recall` computes exact attention for every sparse step (costly).
  MeteredPolicy(KvSelectionPolicy& inner, const ModelConfig& model, int dense_layers,
                bool measure_recall);

  std::string Name() const override { return inner_.Name(); }
  SpeculationInput speculation_input() const override { return inner_.speculation_input(); }
  bool SpeculatesFor(int layer) const override { return inner_.SpeculatesFor(layer); }
  bool wants_attention_weights() const override { return inner_.wants_attention_weights(); }
  bool needs_resident_kv() const override {  // the recall reads every row
    return measure_recall_ || inner_.needs_resident_kv();
  }
  bool Preselect(const SelectRequest& request, Selection& out) override {
    return inner_.Preselect(request, out);
  }
  void Open(SequenceId seq, int64_t capacity_tokens) override { inner_.Open(seq, capacity_tokens); }
  absl::Status OnKeys(const LayerKeys& keys) override { return inner_.OnKeys(keys); }
  absl::Status Select(const SelectRequest& request, Selection& out) override;
  void OnAttentionWeights(SequenceId seq, int layer, const Selection& selection,
                          const float* weights, int64_t rows) override {
    inner_.OnAttentionWeights(seq, layer, selection, weights, rows);
  }
  void Release(SequenceId seq) override { inner_.Release(seq); }

  const SelectionMeter& meter() const { return meter_; }
  void Reset() { meter_ = {}; }

 private:
  KvSelectionPolicy& inner_;
  const ModelConfig& model_;
  int dense_layers_;
  bool measure_recall_;
  // The rows a streamed cache would move for `r`'s selection `out` (per KV head).
  int64_t RowsMoved(const SelectRequest& r, const Selection& out);

  SelectionMeter meter_;
  Selection candidates_;
  bool preselected_ = false;
  std::vector<float> scores_, mass_, sorted_;
};

}  // namespace infinigen
