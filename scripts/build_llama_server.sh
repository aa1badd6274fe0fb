#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama.cpp sources vendored in llama-cpp-python's PyPI
# sdist (this machine reaches PyPI, not GitHub), for `plait bench compare`. CPU build, no CURL,
# no AMX (its path crashed on an earlier machine of this kind). About 20 minutes on 2 cores, one
# job at nice 19. Installs to ${PREFIX:-/usr/local}/bin/llama-server.
set -euo pipefail
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
work="${WORK:-$(mktemp -d)}"
prefix="${PREFIX:-/usr/local}"
cd "$work"
python -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version"
tar xzf "llama_cpp_python-$version.tar.gz"
cd "llama_cpp_python-$version/vendor/llama.cpp"
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 19 cmake --build build --target llama-server -j"${JOBS:-1}"
install -m 755 build/bin/llama-server "$prefix/bin/llama-server"
"$prefix/bin/llama-server" --version
