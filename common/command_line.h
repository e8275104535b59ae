// One way for every binary to parse its flags: a usage text for --help, the
// build summary for --version, and absl's parsing.
#pragma once

#include <vector>

namespace tessera {

// Parses absl flags, spelled with underscores (--metrics_listen) or dashes
// (--metrics-listen: the name part of every "--flag[=value]" argument before a
// bare "--" is rewritten in argv); handles --help (prints `usage`, which begins with a
// "Usage: ..." line, then the binary's flags), exits 0; --helpfull and
// --version. Returns the positional arguments, argv[0] first.
std::vector<char*> ParseCommandLine(int argc, char** argv, const char* usage);

// The rewrite ParseCommandLine applies first: dashes in flag names become
// underscores ("-x" and values are left alone).
void AcceptDashedFlags(int argc, char** argv);

}  // namespace tessera
