#include "frontend/sample_text.h"

#include <utility>

namespace infinigen {

SampleText::SampleText(const Tokenizer* tokenizer, bool skip_special,
                       std::vector<std::string> stop_strings, bool include_stop)
    : stops_(std::move(stop_strings), include_stop) {
  if (tokenizer != nullptr) decoder_.emplace(*tokenizer, skip_special);
}

std::string SampleText::Add(int32_t token) {
  if (!decoder_ || stops_.stopped()) return "";
  return stops_.Add(decoder_->Add(token));
}

std::string SampleText::Finish() {
  if (!decoder_ || stops_.stopped()) return "";
  std::string text = stops_.Add(decoder_->Finish());
  return text + stops_.Finish();
}

}  // namespace infinigen
