// No Abseil header may be included here (sentencepiece_shim.h says why).
#include "model/sentencepiece_train_testing.h"

#include <sentencepiece_trainer.h>

#include <fstream>
#include <sstream>

namespace fluxion::model {

bool TrainSentencePieceForTesting(const std::string& corpus_path, const std::string& flags,
                                  std::string* model, std::string* error) {
  std::ostringstream args;
  args << "--input=" << corpus_path << " --model_prefix=" << corpus_path << ".sp " << flags
       << " --minloglevel=2";
  const sentencepiece::util::Status s = sentencepiece::SentencePieceTrainer::Train(args.str());
  if (!s.ok()) {
    *error = s.ToString();
    return false;
  }
  std::ifstream in(corpus_path + ".sp.model", std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  *model = bytes.str();
  return !model->empty();
}

}  // namespace fluxion::model
