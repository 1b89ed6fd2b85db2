// Test only: trains a small SentencePiece model with Debian's libsentencepiece_train (the tests'
// stand-in for a model's tokenizer.model). Std-only, like sentencepiece_shim.h, for the same
// reason.
#ifndef FLUXION_MODEL_SENTENCEPIECE_TRAIN_TESTING_H_
#define FLUXION_MODEL_SENTENCEPIECE_TRAIN_TESTING_H_

#include <string>

namespace fluxion::model {

// Trains on `corpus_path` with trainer `flags` ("--vocab_size=... --model_type=bpe ...") and
// returns the model's serialized bytes; false with *error set on failure.
bool TrainSentencePieceForTesting(const std::string& corpus_path, const std::string& flags,
                                  std::string* model, std::string* error);

}  // namespace fluxion::model

#endif  // FLUXION_MODEL_SENTENCEPIECE_TRAIN_TESTING_H_
