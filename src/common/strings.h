// Small string helpers shared by the command-line front ends (accuracy suite, benchmark options).
#pragma once
#include <string>
#include <vector>

namespace mxflash::detail {

// "a,b,,c" split at `sep` -> {"a", "b", "", "c"} (empty fields kept; "" gives one empty field).
inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

}  // namespace mxflash::detail
