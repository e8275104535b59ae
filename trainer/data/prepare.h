// The prepare step: tokenizes raw text (.txt documents or JSONL records) into the token shards a
// training job reads, split into train and validation shards. Runs once per corpus, before
// training, on one machine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tessera::trainer {

struct PrepareOptions {
  // .txt files (a whole file is one document) or .jsonl files (one JSON object per line).
  std::vector<std::string> inputs;
  // "text", "jsonl", or "auto": by extension, .jsonl and .ndjson are JSONL and anything else text.
  // A JSONL record is one of:
  //  - a document: its "text" field, or "<instruction>\n\n<response>" from its instruction and
  //    response fields (also prompt / completion); every token counts in the loss;
  //  - an Alpaca record {"instruction", "input" (optional), "output"}: the prompt template
  //    renders instruction and input as the prompt, and output as the response;
  //  - a chat record {"messages": [{"role": "system" | "user" | "assistant", "content"}...]}:
  //    rendered by the chat template, each assistant content being a response.
  // Every document and every response is followed by eos. Prompt tokens are written with loss
  // mask 0 (their loss is not taken), response tokens and their eos with 1.
  std::string format = "auto";
  // How Alpaca records are rendered: "alpaca" (Stanford Alpaca's template: "Below is an
  // instruction ... ### Instruction:\n{instruction}\n\n[### Input:\n{input}\n\n]### Response:\n")
  // or "chat" (as a user message and the assistant's reply). Chat records always use the chat
  // template: "<|role|>\n{content}\n" per system / user message, "<|assistant|>\n" (prompt)
  // then {content}<eos> (response) per assistant message.
  std::string prompt_template = "alpaca";
  // 0: the records are concatenated into one token stream that training cuts into windows
  // anywhere. N > 0: every record becomes one sample of exactly N + 1 tokens (truncated, or
  // padded with eos whose loss is not taken), and the shards say so: training must then use
  // seq_len N. A record with no counted target left after truncation is dropped.
  int seq_len = 0;
  // With seq_len > 0: several records go into one sample while they fit (a record longer than a
  // sample still takes one of its own, truncated). The shards mark where each record begins, and
  // training keeps the records of a sample apart: a token attends only to earlier tokens of its
  // own record, positions restart at each record, and a record's first token is not a target.
  bool pack = false;
  // Where train-00000.bin, train-00001.bin, ..., val-00000.bin, ... are written (created if
  // missing). Shards of an earlier run numbered past this run's are removed.
  std::string output_dir;
  // "byte", the path of a SentencePiece .model, or of a Hugging Face tokenizer.json (or a
  // directory holding one: hf_tokenizer.h).
  std::string tokenizer = "byte";
  // Hugging Face tokenizers only: the added token that ends documents and responses, instead of
  // the one LoadHfTokenizer picks (e.g. "<|im_end|>" for a chat model's turns).
  std::string eos_token;
  // Fraction of the tokens, taken from the end, written to val shards; in [0, 1).
  double val_fraction = 0.05;
  // Tokens per shard file (the last shard of each split may hold fewer).
  uint64_t tokens_per_shard = 1 << 24;
};

struct PrepareResult {
  std::vector<std::string> train_shards;
  std::vector<std::string> val_shards;
  uint64_t train_tokens = 0;
  uint64_t val_tokens = 0;
  uint32_t vocab_size = 0;
  // Records and documents written, and those dropped (nothing left to learn after truncation).
  uint64_t records = 0;
  uint64_t dropped_records = 0;
  // Whether the shards carry a loss mask (some token's loss is not taken).
  bool loss_mask = false;
  // Whether the shards mark where records begin (pack).
  bool record_starts = false;
};

// Tokenizes options.inputs in the order given and writes the shards (token_shard.h: version 1
// for plain documents, version 2 with a loss mask and / or fixed samples otherwise). The whole
// corpus is held in memory as 4-byte tokens while it is split; with seq_len > 0 the validation
// split takes whole samples from the end. Errors name the option or input file at fault, and
// the line for malformed JSONL ("in.jsonl:3: ...").
absl::StatusOr<PrepareResult> PrepareData(const PrepareOptions& options);

}  // namespace tessera::trainer
