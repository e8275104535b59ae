#include "trainer/data/tokenizer.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "trainer/data/sentencepiece_shim.h"

namespace tessera::trainer {
namespace {

constexpr uint32_t kByteEos = 256;
constexpr char kShimName[] = "libtessera_sentencepiece.so";

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<uint32_t> Encode(std::string_view text) const override {
    std::vector<uint32_t> tokens(text.size());
    for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
    return tokens;
  }
  std::string Decode(std::span<const uint32_t> tokens) const override {
    std::string text;
    text.reserve(tokens.size());
    for (uint32_t token : tokens) {
      if (token < 256) text.push_back(static_cast<char>(token));
    }
    return text;
  }
  uint32_t vocab_size() const override { return kByteEos + 1; }
  uint32_t eos_id() const override { return kByteEos; }
};

// The functions of the dlopen()ed SentencePiece shim (see sentencepiece_shim.h).
struct SentencePieceShim {
  TesseraSpmLoadFn load;
  TesseraSpmDestroyFn destroy;
  TesseraSpmPieceSizeFn piece_size;
  TesseraSpmEosIdFn eos_id;
  TesseraSpmEncodeFn encode;
  TesseraSpmDecodeFn decode;
  TesseraSpmTrainFn train;
  TesseraSpmFreeFn free;
};

// Where the shim may be: ../lib/ beside the running binary's directory (build/bin and
// build/tests both have build/lib there), then where this build put it.
std::vector<std::string> ShimCandidates() {
  std::vector<std::string> candidates;
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) candidates.push_back((exe.parent_path() / ".." / "lib" / kShimName).string());
#ifdef TESSERA_SENTENCEPIECE_SHIM_PATH
  candidates.push_back(TESSERA_SENTENCEPIECE_SHIM_PATH);
#endif
  return candidates;
}

absl::StatusOr<SentencePieceShim> OpenShim() {
  std::string errors;
  for (const std::string& path : ShimCandidates()) {
    if (access(path.c_str(), R_OK) != 0) {
      absl::StrAppend(&errors, " ", path, ": not found;");
      continue;
    }
    // A link-map namespace of its own: there libsentencepiece binds to its own protobuf-lite,
    // not to the process's libprotobuf. (RTLD_DEEPBIND would do that too, but it binds the
    // shim's libstdc++ references past the executable's copy-relocated std::cerr, which is then
    // never constructed.) The shim has its own libc and libstdc++ there; only plain memory
    // crosses, and what it allocates it frees.
    void* handle = dlmopen(LM_ID_NEWLM, path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      absl::StrAppend(&errors, " ", dlerror(), ";");
      continue;
    }
    SentencePieceShim shim;
    const auto find = [&](const char* name) {
      void* symbol = dlsym(handle, name);
      if (symbol == nullptr) absl::StrAppend(&errors, " ", path, ": lacks ", name, ";");
      return symbol;
    };
    shim.load = reinterpret_cast<TesseraSpmLoadFn>(find("tessera_spm_load"));
    shim.destroy = reinterpret_cast<TesseraSpmDestroyFn>(find("tessera_spm_destroy"));
    shim.piece_size = reinterpret_cast<TesseraSpmPieceSizeFn>(find("tessera_spm_piece_size"));
    shim.eos_id = reinterpret_cast<TesseraSpmEosIdFn>(find("tessera_spm_eos_id"));
    shim.encode = reinterpret_cast<TesseraSpmEncodeFn>(find("tessera_spm_encode"));
    shim.decode = reinterpret_cast<TesseraSpmDecodeFn>(find("tessera_spm_decode"));
    shim.train = reinterpret_cast<TesseraSpmTrainFn>(find("tessera_spm_train"));
    shim.free = reinterpret_cast<TesseraSpmFreeFn>(find("tessera_spm_free"));
    if (shim.load && shim.destroy && shim.piece_size && shim.eos_id && shim.encode && shim.decode &&
        shim.train && shim.free) {
      return shim;  // the handle stays open for the life of the process
    }
    dlclose(handle);
  }
  return absl::FailedPreconditionError(
      absl::StrCat("cannot load the SentencePiece library ", kShimName, ":", errors));
}

// Opened once per process.
const absl::StatusOr<SentencePieceShim>& Shim() {
  static const absl::StatusOr<SentencePieceShim>* const shim =
      new absl::StatusOr<SentencePieceShim>(OpenShim());
  return *shim;
}

// Takes a malloc'd message from the shim.
std::string TakeError(const SentencePieceShim& shim, char* error) {
  std::string message = error != nullptr ? error : "unknown error";
  shim.free(error);
  return message;
}

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const SentencePieceShim& shim, TesseraSpm* model, uint32_t vocab_size,
                         uint32_t eos_id)
      : shim_(shim), model_(model), vocab_size_(vocab_size), eos_id_(eos_id) {}
  ~SentencePieceTokenizer() override { shim_.destroy(model_); }
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  std::vector<uint32_t> Encode(std::string_view text) const override {
    int* ids = nullptr;
    size_t count = 0;
    // Encoding with a loaded model fails only on an internal error; such text yields no tokens.
    if (shim_.encode(model_, text.data(), text.size(), &ids, &count) != 0) return {};
    std::vector<uint32_t> tokens(ids, ids + count);
    shim_.free(ids);
    return tokens;
  }
  std::string Decode(std::span<const uint32_t> tokens) const override {
    std::vector<int> ids;
    ids.reserve(tokens.size());
    for (uint32_t token : tokens) {
      if (token < vocab_size_) ids.push_back(static_cast<int>(token));
    }
    char* text = nullptr;
    size_t size = 0;
    if (shim_.decode(model_, ids.data(), ids.size(), &text, &size) != 0) return {};
    std::string decoded(text, size);
    shim_.free(text);
    return decoded;
  }
  uint32_t vocab_size() const override { return vocab_size_; }
  uint32_t eos_id() const override { return eos_id_; }

 private:
  const SentencePieceShim& shim_;
  TesseraSpm* model_;
  uint32_t vocab_size_;
  uint32_t eos_id_;
};

}  // namespace

std::unique_ptr<Tokenizer> MakeByteTokenizer() { return std::make_unique<ByteTokenizer>(); }

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadSentencePieceTokenizer(
    const std::string& model_path) {
  struct stat st;
  if (stat(model_path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat(model_path, ": no such SentencePiece model"));
  }
  if (!Shim().ok()) return Shim().status();
  const SentencePieceShim& shim = *Shim();
  char* error = nullptr;
  TesseraSpm* model = shim.load(model_path.c_str(), &error);
  if (model == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(model_path, ": not a SentencePiece model: ", TakeError(shim, error)));
  }
  const int vocab_size = shim.piece_size(model);
  const int eos_id = shim.eos_id(model);
  if (eos_id < 0) {
    shim.destroy(model);
    return absl::InvalidArgumentError(absl::StrCat(
        model_path, ": the SentencePiece model has no eos piece (train it with --eos_id >= 0)"));
  }
  return std::make_unique<SentencePieceTokenizer>(shim, model, static_cast<uint32_t>(vocab_size),
                                                  static_cast<uint32_t>(eos_id));
}

absl::Status TrainSentencePieceModel(const std::string& args) {
  if (!Shim().ok()) return Shim().status();
  const SentencePieceShim& shim = *Shim();
  char* error = nullptr;
  if (shim.train(args.c_str(), &error) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SentencePiece training failed (", args, "): ", TakeError(shim, error)));
  }
  return absl::OkStatus();
}

}  // namespace tessera::trainer
