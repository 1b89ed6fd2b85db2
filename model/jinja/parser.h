// Jinja template text -> Body (ast.h), with transformers' environment settings: trim_blocks (the
// newline after a block tag goes), lstrip_blocks (spaces and tabs before a block tag on its line
// go), and `-` / `+` whitespace control on every tag.
#ifndef FLUXION_MODEL_JINJA_PARSER_H_
#define FLUXION_MODEL_JINJA_PARSER_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/jinja/ast.h"

namespace fluxion::model::jinja {

// InvalidArgument naming the line for text that is not a template this interpreter reads.
absl::StatusOr<Body> ParseTemplate(absl::string_view source);

}  // namespace fluxion::model::jinja

#endif  // FLUXION_MODEL_JINJA_PARSER_H_
