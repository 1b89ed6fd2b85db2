#include "model/json_text.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace fluxion::model {
namespace {

using Json = nlohmann::json;

class JsonPrescan : public nlohmann::json_sax<Json> {
 public:
  explicit JsonPrescan(const JsonTextOptions& options) : options_(options) {}

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return Enter(); }
  bool key(string_t& key) override {
    if (options_.reject_duplicate_top_level_keys && depth_ == 1 &&
        !top_level_keys_.insert(key).second && duplicate_key.empty()) {
      duplicate_key = key;
    }
    return true;
  }
  bool end_object() override { return Leave(); }
  bool start_array(std::size_t) override { return Enter(); }
  bool end_array() override { return Leave(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) override {
    syntax_error = e.what();
    return false;
  }

  std::string syntax_error;
  std::string duplicate_key;

 private:
  bool Enter() {
    if (++depth_ <= options_.max_depth) return true;
    syntax_error = absl::StrCat("nested deeper than ", options_.max_depth, " levels");
    return false;
  }
  bool Leave() {
    --depth_;
    return true;
  }

  const JsonTextOptions& options_;
  int depth_ = 0;
  std::set<std::string> top_level_keys_;
};

}  // namespace

absl::StatusOr<Json> ParseJsonText(absl::string_view text, absl::string_view what,
                                   const JsonTextOptions& options) {
  JsonPrescan scanner(options);
  if (!Json::sax_parse(text.begin(), text.end(), &scanner)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not valid JSON: ", scanner.syntax_error));
  }
  if (!scanner.duplicate_key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " names '", scanner.duplicate_key, "' twice"));
  }
  Json root = Json::parse(text.begin(), text.end(), /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not valid JSON"));
  }
  return root;
}

absl::StatusOr<std::string> ReadFileBounded(const std::string& path, size_t limit) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
    return absl::ErrnoToStatus(errno, absl::StrCat("opening ", path));
  }
  // The descriptor closes on every return below.
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  std::string contents;
  std::string buffer(1 << 16, '\0');
  while (true) {
    const ssize_t n = read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, absl::StrCat("reading ", path));
    if (n == 0) break;
    if (contents.size() + static_cast<size_t>(n) > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " is larger than the limit of ", limit, " bytes"));
    }
    contents.append(buffer.data(), static_cast<size_t>(n));
  }
  return contents;
}

}  // namespace fluxion::model
