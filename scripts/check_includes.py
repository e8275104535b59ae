#!/usr/bin/env python3
"""The include-level half of the module rules: a file may include only headers of its own target
and of the project's libraries that its target links (directly or through another library).

The link half is CMake's: each library lists in its folder's CMakeLists.txt what it may link,
and the layering rules of the top CMakeLists.txt stop the configure when a library reaches what
it must never link. But every target compiles with the repository root on its include path, so
a file could include a header of a library its target does not link and build as long as it
used nothing out of line. This catches that, from what the build itself says:

- build/compile_commands.json: every file compiled, and its target (the object file's
  `CMakeFiles/<target>.dir/` path);
- build/tessera_modules.json, written at configure time (cmake/TesseraLayers.cmake): each
  target's folder, sources and link closure.

A header belongs to the targets that compile the .cc of the same name beside it, else to the one
library with sources in its folder (or, of several, the one named after the folder:
tessera_common for common/), and what it includes is checked as theirs; a header with no
such owner (a folder of several libraries and no .cc of its name), test support (`*_fixture.h`,
`*_fake.h`, `*_golden.h`, which belongs to the tests that include it) and the exemptions below are counted and
left alone. Generated headers (the contract's .pb.h) and
system headers are not the project's to check.

  scripts/check_includes.py [BUILD_DIR]     exit 1 and one line per offending include
  CHECK_INCLUDES_VERBOSE=1 also lists the headers left alone
  scripts/check_includes.py --root DIR BUILD_DIR   check another tree (tests/layering)
"""

import collections
import json
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
TARGET_OF_OBJECT = re.compile(r"(?:^|\s)-o\s+\S*?CMakeFiles/([^/\s]+)\.dir/")
# Test support (fixtures, fakes, simulated time) lives beside the code it drives but belongs to
# the tests that include it, which link what it needs.
TEST_SUPPORT = ("_fixture.h", "_fake.h", "_golden.h")
# Headers whose owner is not the library that compiles their twin: the shared LibTorch
# precompiled header is compiled once by tessera_torch_pch, and every target that includes it
# links LibTorch through tessera_torch.
OWNER = {"trainer/torch_pch.h": "tessera_torch"}
# Headers that are an interface without a link, each with its reason.
EXEMPT = {
    # The tokenizer dlmopen()s the SentencePiece shim into a namespace of its own; this header is
    # the C ABI both sides compile, and linking the shim is what the design avoids.
    "trainer/data/sentencepiece_shim.h",
}
LIBRARY_TYPES = {"STATIC_LIBRARY", "SHARED_LIBRARY", "OBJECT_LIBRARY", "INTERFACE_LIBRARY"}


def main():
    args = sys.argv[1:]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args[:1] == ["--root"]:  # another tree (the script's own test)
        root, args = os.path.abspath(args[1]), args[2:]
    build = os.path.abspath(args[0] if args else os.path.join(root, "build"))
    modules_path = os.path.join(build, "tessera_modules.json")
    commands_path = os.path.join(build, "compile_commands.json")
    for path in (modules_path, commands_path):
        if not os.path.exists(path):
            sys.exit(f"check_includes: {path} is missing; configure {build} first (make configure)")
    with open(modules_path) as f:
        modules = json.load(f)
    with open(commands_path) as f:
        commands = json.load(f)

    # Who owns a header: the target compiling its .cc twin, else the one library in its folder.
    owners_of_source = collections.defaultdict(set)
    libraries_in = collections.defaultdict(set)
    for target, module in modules.items():
        for source in module["sources"]:
            owners_of_source[source].add(target)
            if module["type"] in LIBRARY_TYPES:
                libraries_in[os.path.dirname(source)].add(target)

    def owners(header):
        """The targets a header belongs to (several when its .cc is compiled into several)."""
        if os.path.basename(header).endswith(TEST_SUPPORT):
            return set()
        if os.path.relpath(header, root) in OWNER:
            return {OWNER[os.path.relpath(header, root)]}
        twin = os.path.splitext(header)[0] + ".cc"
        if twin in owners_of_source:
            return owners_of_source[twin]
        folder = os.path.dirname(header)
        libraries = libraries_in.get(folder, set())
        if len(libraries) == 1:
            return libraries
        named = "tessera_" + os.path.basename(folder)  # the folder's own library: common/'s
        return {named} if named in libraries else set()

    # An object library's files are part of the targets that compile its objects in, and may
    # include what those link.
    allowed_of = {target: {target, *module["links"]} for target, module in modules.items()}
    for target, module in modules.items():
        for part in module.get("objects_of", []):
            if part in allowed_of:
                allowed_of[part] |= allowed_of[target]

    violations = []
    checked_files = 0
    checked_includes = 0
    unowned = set()
    seen = set()
    files = []
    for command in commands:
        source = os.path.normpath(os.path.join(command["directory"], command["file"]))
        if not source.startswith(root + os.sep) or source.startswith(build + os.sep):
            continue
        text = command.get("command") or " ".join(command.get("arguments", []))
        match = TARGET_OF_OBJECT.search(text)
        if not match or match.group(1) not in modules:
            continue
        target = match.group(1)
        if (source, target) in seen:
            continue
        seen.add((source, target))
        files.append((source, target))

    # Headers are checked as their owner's: what a header includes, its owner must link.
    folders = {os.path.dirname(source) for source, _ in files}
    for folder in sorted(folders):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".h"):
                header = os.path.join(folder, name)
                for header_owner in sorted(owners(header)):
                    files.append((header, header_owner))

    for source, target in files:
        allowed = allowed_of[target]
        checked_files += 1
        with open(source, errors="replace") as f:
            includes = INCLUDE.findall(f.read())
        for include in includes:
            header = os.path.join(root, include)
            if not os.path.isfile(header):
                continue  # generated or a system header
            checked_includes += 1
            header_owners = owners(header)
            if include in EXEMPT or not header_owners:
                unowned.add(include)
                continue
            if not header_owners & allowed:
                violations.append(
                    f"{os.path.relpath(source, root)} ({target}) includes {include}, a header of "
                    f"{' or '.join(sorted(header_owners))}, which {target} does not link")

    for line in sorted(violations):
        print(line)
    if os.environ.get("CHECK_INCLUDES_VERBOSE"):
        for header in sorted(unowned):
            print(f"left alone: {header}", file=sys.stderr)
    print(f"check_includes: {checked_files} files, {checked_includes} project includes, "
          f"{len(violations)} outside their target's links, {len(unowned)} headers with no "
          f"single owner left alone", file=sys.stderr)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
