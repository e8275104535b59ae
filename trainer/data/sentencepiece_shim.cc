// libtessera_sentencepiece.so: see sentencepiece_shim.h. Built with hidden visibility; only the
// tessera_spm_* functions are exported.
#include "trainer/data/sentencepiece_shim.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#define TESSERA_SPM_EXPORT extern "C" __attribute__((visibility("default")))

struct TesseraSpm {
  sentencepiece::SentencePieceProcessor processor;
};

namespace {

char* CopyString(std::string_view s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out == nullptr) return nullptr;
  std::memcpy(out, s.data(), s.size());
  out[s.size()] = '\0';
  return out;
}

}  // namespace

TESSERA_SPM_EXPORT TesseraSpm* tessera_spm_load(const char* path, char** error) {
  auto* model = new TesseraSpm;
  const sentencepiece::util::Status status = model->processor.Load(path);
  if (!status.ok()) {
    *error = CopyString(status.ToString());
    delete model;
    return nullptr;
  }
  return model;
}

TESSERA_SPM_EXPORT void tessera_spm_destroy(TesseraSpm* model) { delete model; }

TESSERA_SPM_EXPORT int tessera_spm_piece_size(const TesseraSpm* model) {
  return model->processor.GetPieceSize();
}

TESSERA_SPM_EXPORT int tessera_spm_eos_id(const TesseraSpm* model) {
  return model->processor.eos_id();
}

TESSERA_SPM_EXPORT int tessera_spm_encode(const TesseraSpm* model, const char* text, size_t size,
                                          int** ids, size_t* count) {
  std::vector<int> encoded;
  if (!model->processor.Encode(std::string_view(text, size), &encoded).ok()) return 1;
  *ids = static_cast<int*>(std::malloc(std::max<size_t>(encoded.size(), 1) * sizeof(int)));
  if (*ids == nullptr) return 1;
  if (!encoded.empty()) std::memcpy(*ids, encoded.data(), encoded.size() * sizeof(int));
  *count = encoded.size();
  return 0;
}

TESSERA_SPM_EXPORT int tessera_spm_decode(const TesseraSpm* model, const int* ids, size_t count,
                                          char** text, size_t* size) {
  std::string decoded;
  if (!model->processor.Decode(std::vector<int>(ids, ids + count), &decoded).ok()) return 1;
  *text = CopyString(decoded);
  if (*text == nullptr) return 1;
  *size = decoded.size();
  return 0;
}

TESSERA_SPM_EXPORT int tessera_spm_train(const char* args, char** error) {
  const sentencepiece::util::Status status = sentencepiece::SentencePieceTrainer::Train(args);
  if (!status.ok()) {
    *error = CopyString(status.ToString());
    return 1;
  }
  return 0;
}

TESSERA_SPM_EXPORT void tessera_spm_free(void* buffer) { std::free(buffer); }
