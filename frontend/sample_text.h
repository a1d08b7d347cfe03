// The text of one generated sample as a client receives it: its tokens decoded one at a time
// (a delta never splits a UTF-8 character) and cut at the first stop string (text that may
// begin one is held back until a later token decides). The worker's API streams these deltas;
// the CLI prints them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "frontend/stop_strings.h"
#include "gpu_worker/tokenizer/tokenizer.h"

namespace infinigen {

class SampleText {
 public:
  // `tokenizer` null: a model without tokenizer files, whose samples have no text (and so no
  // stop strings: the request front end refuses them). `tokenizer` must outlive this.
  SampleText(const Tokenizer* tokenizer, bool skip_special, std::vector<std::string> stop_strings,
             bool include_stop);

  // The text that can be sent after `token` (often empty); nothing once stopped().
  std::string Add(int32_t token);
  // At the end of the sample: what was held back (nothing after a stop).
  std::string Finish();
  bool has_text() const { return decoder_.has_value(); }
  // A stop string ended the text; the sample should end.
  bool stopped() const { return stops_.stopped(); }
  const std::string& matched_stop() const { return stops_.matched(); }

 private:
  std::optional<IncrementalDecoder> decoder_;
  StopStringFilter stops_;
};

}  // namespace infinigen
