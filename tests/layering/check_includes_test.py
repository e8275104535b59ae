#!/usr/bin/env python3
"""scripts/check_includes.py on trees of its own: an include of a library the target does not
link fails, naming the file, the header and its library; linking it passes; a header's own
includes are checked as its library's; test support (*_fixture.h) is left alone; an object
library's files may include what the library that compiles them in links."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                      "check_includes.py")


class CheckIncludesTest(unittest.TestCase):
    def tree(self, files, modules):
        """Writes `files` under a new root, and a build dir whose compile commands compile every
        .cc/.cu of each module's sources into that module."""
        root = tempfile.mkdtemp()
        for path, text in files.items():
            os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
            with open(os.path.join(root, path), "w") as f:
                f.write(text)
        build = os.path.join(root, "build")
        os.makedirs(build)
        commands, module_map = [], {}
        for target, (type_, sources, links, objects_of) in modules.items():
            module_map[target] = {
                "dir": os.path.join(root, os.path.dirname(sources[0])), "type": type_,
                "sources": [os.path.join(root, s) for s in sources], "links": links,
                "objects_of": objects_of}
            for source in sources:
                commands.append({
                    "directory": build, "file": os.path.join(root, source),
                    "command": f"c++ -I{root} -o {os.path.dirname(source)}/CMakeFiles/"
                               f"{target}.dir/{os.path.basename(source)}.o -c "
                               f"{os.path.join(root, source)}"})
        with open(os.path.join(build, "compile_commands.json"), "w") as f:
            json.dump(commands, f)
        with open(os.path.join(build, "tessera_modules.json"), "w") as f:
            json.dump(module_map, f)
        return subprocess.run([sys.executable, SCRIPT, "--root", root, build],
                              capture_output=True, text=True)

    LOW = {"low/low.h": "#pragma once\n", "low/low.cc": '#include "low/low.h"\n'}

    def test_an_include_of_an_unlinked_library_fails(self):
        run = self.tree({**self.LOW, "app/app.cc": '#include "low/low.h"\n'},
                        {"low": ("STATIC_LIBRARY", ["low/low.cc"], [], []),
                         "app": ("EXECUTABLE", ["app/app.cc"], [], [])})
        self.assertEqual(run.returncode, 1, run.stderr)
        self.assertIn("app/app.cc (app) includes low/low.h, a header of low, which app does not "
                      "link", run.stdout)

    def test_linking_the_library_passes(self):
        run = self.tree({**self.LOW, "app/app.cc": '#include "low/low.h"\n'},
                        {"low": ("STATIC_LIBRARY", ["low/low.cc"], [], []),
                         "app": ("EXECUTABLE", ["app/app.cc"], ["low"], [])})
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("0 outside their target's links", run.stderr)

    def test_a_header_is_checked_as_its_librarys(self):
        run = self.tree({**self.LOW, "mid/mid.h": '#pragma once\n#include "low/low.h"\n',
                         "mid/mid.cc": '#include "mid/mid.h"\n'},
                        {"low": ("STATIC_LIBRARY", ["low/low.cc"], [], []),
                         "mid": ("STATIC_LIBRARY", ["mid/mid.cc"], [], [])})
        self.assertEqual(run.returncode, 1)
        self.assertIn("mid/mid.h (mid) includes low/low.h", run.stdout)

    def test_test_support_is_left_alone(self):
        run = self.tree({**self.LOW, "mid/mid_fixture.h": '#pragma once\n#include "low/low.h"\n',
                         "mid/mid.cc": "\n"},
                        {"low": ("STATIC_LIBRARY", ["low/low.cc"], [], []),
                         "mid": ("STATIC_LIBRARY", ["mid/mid.cc"], [], [])})
        self.assertEqual(run.returncode, 0, run.stdout)

    def test_an_object_librarys_files_take_their_consumers_links(self):
        files = {**self.LOW, "k/kernels.cu": '#include "low/low.h"\n', "k/k.cc": "\n"}
        modules = {"low": ("STATIC_LIBRARY", ["low/low.cc"], [], []),
                   "objs": ("OBJECT_LIBRARY", ["k/kernels.cu"], [], [])}
        run = self.tree(files, {**modules, "k": ("STATIC_LIBRARY", ["k/k.cc"], ["low"], ["objs"])})
        self.assertEqual(run.returncode, 0, run.stdout)
        run = self.tree(files, {**modules, "k": ("STATIC_LIBRARY", ["k/k.cc"], [], ["objs"])})
        self.assertEqual(run.returncode, 1)
        self.assertIn("k/kernels.cu (objs) includes low/low.h", run.stdout)


if __name__ == "__main__":
    unittest.main()
