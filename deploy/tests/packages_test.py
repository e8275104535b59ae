#!/usr/bin/env python3
"""The Debian package lists (deploy/packages/) are what the builds really use.

scripts/bootstrap.sh installs deploy/packages/build and deploy/packages/test; the images'
Dockerfile installs deploy/packages/build in its build stages and nothing else. This test
configures the images' build here (CPU, no tests, no benchmarks: what deploy/docker/Dockerfile
runs) into a scratch directory, then asks dpkg which package owns every file the configure found
under /usr (libraries, headers, CMake configs, pkg-config modules, programs) and fails when one
is not a package listed in deploy/packages/build or a package those depend on: the library
would be on this machine through some other way and missing in the image. It also checks that
the Dockerfile and bootstrap.sh read the lists instead of naming packages of their own.

Exit 77 (skipped) on a machine without dpkg.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

# CMake cache entries that name the compiler and CMake's own tools: the toolchain, which
# build-essential and cmake bring, not libraries the project chose.
TOOLCHAIN_ENTRY = re.compile(r"^(CMAKE_|_|ProcessorCount_)")


def read_list(path):
    names = []
    with open(path) as f:
        for line in f:
            names.extend(line.split("#", 1)[0].split())
    return names


def installed_packages():
    """{package: (depends, provides)} of every installed package."""
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package}\t${Status}\t${Pre-Depends}, ${Depends}\t${Provides}\n"],
        check=True, capture_output=True, text=True).stdout
    packages = {}
    for line in out.splitlines():
        name, status, depends, provides = (line.split("\t") + ["", "", ""])[:4]
        if "ok installed" not in status:
            continue
        packages[name] = (depends, provides)
    return packages


def closure(roots, packages):
    """The installed packages that `roots` pull in through Depends and Pre-Depends."""
    provided_by = {}
    for name, (_, provides) in packages.items():
        for entry in provides.split(","):
            virtual = entry.strip().split(" ")[0].split(":")[0]
            if virtual:
                provided_by.setdefault(virtual, []).append(name)
    seen = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in packages:
            continue
        for clause in packages[name][0].split(","):
            for alternative in clause.split("|"):
                dep = alternative.strip().split(" ")[0].split(":")[0]
                if not dep:
                    continue
                if dep in packages:
                    todo.append(dep)
                    break
                if dep in provided_by:
                    todo.extend(provided_by[dep])
                    break
    return seen


def owners(path):
    """The packages that own `path`: as named, resolved, and (merged /usr) without /usr."""
    candidates = [path, os.path.realpath(path)]
    candidates += [c[len("/usr"):] for c in list(candidates)
                   if re.match(r"^/usr/(lib|lib64|bin|sbin)/", c)]
    for candidate in candidates:
        result = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
        if result.returncode != 0:
            continue
        found = set()
        for line in result.stdout.splitlines():
            names, _, _ = line.partition(": ")
            for name in names.split(", "):
                found.add(name.split(":")[0])
        return found
    return set()


def found_paths(cache):
    """(entry, path) of the configure's findings under /usr, outside /usr/local."""
    entry_re = re.compile(r"^([^:#/]+):(PATH|FILEPATH)=(.+)$")
    found = []
    with open(cache) as f:
        for line in f:
            match = entry_re.match(line.strip())
            if not match or TOOLCHAIN_ENTRY.match(match.group(1)):
                continue
            for path in match.group(3).split(";"):
                path = os.path.normpath(path)
                if path.startswith("/usr/") and not path.startswith("/usr/local/") and \
                        os.path.exists(path):
                    found.append((match.group(1), path))
    return found


def pkg_config_modules(cache):
    modules = []
    with open(cache) as f:
        for line in f:
            match = re.match(r"^__pkg_config_arguments_\w+:INTERNAL=(.+)$", line.strip())
            if match:
                modules.extend(m for m in match.group(1).split(";")
                               if m and m not in ("REQUIRED", "QUIET", "IMPORTED_TARGET"))
    return modules


def check_sources_read_lists(source):
    problems = []
    dockerfile = open(os.path.join(source, "deploy/docker/Dockerfile")).read()
    for stage_list in ("deploy/packages/build", "deploy/packages/run", "deploy/packages/run-gpu"):
        if stage_list not in dockerfile:
            problems.append(f"deploy/docker/Dockerfile does not install {stage_list}")
    # Every apt-get install in the Dockerfile takes its names from a list (or the CUDA toolkit's
    # own argument): a package named in place is a list of its own that drifts.
    for command in re.findall(r"apt-get install([^&]*)", dockerfile.replace("\\\n", " ")):
        for word in re.sub(r"\$\([^)]*\)", " ", command).split():
            if word.startswith("-") or word.startswith("$"):
                continue
            problems.append(f"deploy/docker/Dockerfile installs {word!r} outside deploy/packages/")
    bootstrap = open(os.path.join(source, "scripts/bootstrap.sh")).read()
    for name in ("build", "test"):
        if f'"$packages_dir/{name}"' not in bootstrap:
            problems.append(f"scripts/bootstrap.sh does not install deploy/packages/{name}")
    return problems


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", required=True)
    parser.add_argument("--python", required=True, help="the python holding torch")
    parser.add_argument("--cache", help="a configured CMakeCache.txt to check instead of "
                        "configuring the image's build")
    args = parser.parse_args()
    if shutil.which("dpkg-query") is None or shutil.which("dpkg") is None:
        print("SKIP: no dpkg on this machine")
        return 77

    problems = check_sources_read_lists(args.source)
    lists = os.path.join(args.source, "deploy/packages")
    build = read_list(os.path.join(lists, "build"))
    for name in ("test", "run", "run-gpu"):
        read_list(os.path.join(lists, name))
    packages = installed_packages()
    missing = [p for p in build if p not in packages]
    if missing:
        problems.append("deploy/packages/build names packages not installed here: " +
                        " ".join(missing) + " (run scripts/bootstrap.sh)")
    allowed = closure(build, packages)

    with tempfile.TemporaryDirectory(prefix="packages_test.") as scratch:
        cache = args.cache
        if cache is None:
            configure = subprocess.run(
                ["cmake", "-S", args.source, "-B", scratch, "-G", "Ninja",
                 "-DCMAKE_BUILD_TYPE=Release", "-DTESSERA_WITH_CUDA=OFF",
                 "-DTESSERA_BUILD_TESTS=OFF", "-DTESSERA_BUILD_BENCH=OFF",
                 f"-DTESSERA_PYTHON={args.python}"],
                capture_output=True, text=True)
            if configure.returncode != 0:
                print(configure.stdout[-4000:], configure.stderr[-4000:])
                print("FAIL: the images' configure failed here")
                return 1
            cache = os.path.join(scratch, "CMakeCache.txt")
        findings = found_paths(cache)
        for module in pkg_config_modules(cache):
            pc = subprocess.run(["pkg-config", "--path", module], capture_output=True, text=True)
            if pc.returncode == 0 and pc.stdout.strip():
                findings.append((f"pkg-config {module}", os.path.normpath(pc.stdout.strip())))
        if not findings:
            problems.append(f"{cache} names nothing under /usr: the check would pass vacuously")
        checked = 0
        for entry, path in findings:
            by = owners(path)
            if not by:
                if os.path.isfile(path):
                    problems.append(f"{entry}={path} belongs to no Debian package")
                continue
            checked += 1
            if not by & allowed:
                problems.append(f"{entry}={path} comes from {', '.join(sorted(by))}, which "
                                "deploy/packages/build neither lists nor pulls in")
    print(f"{checked} findings of the images' configure checked against "
          f"{len(build)} listed build packages ({len(allowed)} with their dependencies)")
    for problem in problems:
        print("FAIL:", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
