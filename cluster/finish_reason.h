// The text both front ends give a fluxion.v1 finish reason: OpenAI's `finish_reason` and
// VllmEngine's GenerateComplete.finish_reason use the same words ("stop", "length"; "abort" as
// vLLM reports a request aborted through its Abort RPC, which OpenAI has no word for).
#ifndef FLUXION_CLUSTER_FINISH_REASON_H_
#define FLUXION_CLUSTER_FINISH_REASON_H_

#include "fluxion/v1/decode.pb.h"

namespace fluxion::cluster {

inline const char* FinishReasonText(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_ABORT:
      return "abort";
    default:
      // ERROR is never sent inside `complete`, UNSPECIFIED only by a non-conforming node (the
      // error path reports those). "error" is no OpenAI finish reason, but it says what happened
      // instead of claiming a stop.
      return "error";
  }
}

}  // namespace fluxion::cluster

#endif  // FLUXION_CLUSTER_FINISH_REASON_H_
