// mxflash-accuracy: SQNR / cosine of every attention method against the FP64 reference on the
// ARCHITECTURE.md §3 distribution suite. All the work is in mxflash::accuracy::run_cli.
#include <iostream>
#include <string>
#include <vector>

#include "reference/accuracy_suite.h"

int main(int argc, char** argv) {
  return mxflash::accuracy::run_cli(std::vector<std::string>(argv + 1, argv + argc), std::cout, std::cerr);
}
