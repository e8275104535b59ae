// The C interface of libtessera_sentencepiece.so, a small shared library that wraps
// libsentencepiece. Debian's libsentencepiece carries its own protobuf-lite 3.14 and exports its
// symbols, which clash with the system libprotobuf 3.21 that our generated protos need: in one
// link-map namespace either copy ends up calling the other ("This program was compiled against
// version 3.14.0 of the Protocol Buffer runtime library, which is not compatible with the
// installed version (3.21.12)"). tokenizer.cc therefore never links libsentencepiece; it loads
// this shim with dlmopen(LM_ID_NEWLM) into a namespace of its own (with its own libc and
// libstdc++) and calls it through these plain-C functions. Only plain memory crosses: inputs are
// read in place, outputs and error messages are malloc'd by the shim and must be released with
// tessera_spm_free (the shim's free, not ours).
#pragma once

#include <stddef.h>

extern "C" {

typedef struct TesseraSpm TesseraSpm;

// A loaded model, or NULL with *error set.
typedef TesseraSpm* (*TesseraSpmLoadFn)(const char* path, char** error);
typedef void (*TesseraSpmDestroyFn)(TesseraSpm* model);
typedef int (*TesseraSpmPieceSizeFn)(const TesseraSpm* model);
// -1 when the model has no eos piece.
typedef int (*TesseraSpmEosIdFn)(const TesseraSpm* model);
// 0 on success with *ids (malloc'd) of *count ids.
typedef int (*TesseraSpmEncodeFn)(const TesseraSpm* model, const char* text, size_t size, int** ids,
                                  size_t* count);
// 0 on success with *text (malloc'd) of *size bytes.
typedef int (*TesseraSpmDecodeFn)(const TesseraSpm* model, const int* ids, size_t count,
                                  char** text, size_t* size);
// Trains a model with SentencePieceTrainer (spm_train's flags); 0 on success, else *error set.
typedef int (*TesseraSpmTrainFn)(const char* args, char** error);
typedef void (*TesseraSpmFreeFn)(void* buffer);

}  // extern "C"
