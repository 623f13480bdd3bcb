#!/usr/bin/env bash
# Every GPU measurement, in stages that each fit one 10-minute device call. Run from the
# repository root with the machine's own python (torch, triton, transformers, pytest
# preinstalled) and the carried wheels below:
#
#   bash benchmarks/gpu_session.sh tests   OUT_DIR   # GPU-marked tests, the engine suite on CUDA
#   bash benchmarks/gpu_session.sh kernels OUT_DIR   # kernel_bench --sweep
#   bash benchmarks/gpu_session.sh engine  OUT_DIR   # step latency, beam, profile, host work
#   bash benchmarks/gpu_session.sh offline OUT_DIR   # offline throughput, gpt2 and gpt2-medium
#   bash benchmarks/gpu_session.sh serve   OUT_DIR   # `octavo serve` vs offline; TTFT/ITL
#   bash benchmarks/gpu_session.sh arrivals OUT_DIR  # steps under arrivals, --prefill-interval
#   bash benchmarks/gpu_session.sh speculative OUT_DIR  # n-gram and draft-model speculation on
#       # the embedded model at batch 1 (1 / tok/s is the ITL) and 8, fp16 and float32
#   bash benchmarks/gpu_session.sh lora OUT_DIR  # the LoRA tests on CUDA (Triton BGMV kernels
#       # against PEFT's merged models), then 8 adapters of rank 16 mixed against the base
#   bash benchmarks/gpu_session.sh piecewise OUT_DIR  # piecewise graphs (the CUDA default) against eager;
#       # latency at --prefill-interval 8 (the CUDA default) and 1
#   bash benchmarks/gpu_session.sh served_loss OUT_DIR  # where served throughput and one
#       # stream's first token go: stacks of offline and of every server process; TTFT's parts
#   BEFORE_ROOT=DIR bash benchmarks/gpu_session.sh served_loss_compare OUT_DIR
#       # served_loss's measurements of this tree against BEFORE_ROOT's, the kernel and
#       # engine GPU tests first, and how much one busy thread slows when others run
#   BEFORE_ROOT=DIR bash benchmarks/gpu_session.sh compare OUT_DIR
#       # the decode-step profile (step time, GPU busy, kernels per step) of this tree and of
#       # the checkout in DIR, alternated, two rounds; the GPU-marked tests between them
#   BEFORE_ROOT=DIR bash benchmarks/gpu_session.sh fusions OUT_DIR
#       # kernel_bench here and in BEFORE_ROOT, then `compare` at batches 1, 8, 16, 64
#       # and 256
#   BEFORE_ROOT=DIR bash benchmarks/gpu_session.sh serve_compare OUT_DIR
#       # the serve stage's requests served by this tree and by BEFORE_ROOT in one run
#       # (a serving change measured against its commit before)
#
# The GPU machine lacks packages the engine imports (llguidance, msgspec, pyzmq: every stage
# needs them) and the server's: `bash benchmarks/gpu_wheels.sh` fetches them here as wheels
# into .whl/ (the versions in .venv); carry .whl there and install them first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit;
# For `compare`, put the other checkout in an ignored folder of this one and carry it too:
#   mkdir .before && git archive REV | tar -x -C .before
#
# Logs and result JSON land in OUT_DIR; commit the JSON under benchmarks/results/ with the
# device in its name. A failing command is logged and the stage goes on; the exit status is
# that of the first failure.
set -u
usage="usage: gpu_session.sh tests|kernels|engine|offline|serve|served_loss|served_loss_compare|arrivals|piecewise|speculative|lora|compare|fusions|serve_compare OUT_DIR"
stage=${1:?$usage}
out=${2:?$usage}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
status=0

step() {  # step NAME COMMAND...: runs COMMAND, output to OUT_DIR/NAME.log, timed
    local name=$1
    shift
    echo "== $name: $*"
    local start=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - start)) s"
    tail -n 25 "$out/$name.log"
    [[ $rc -ne 0 && $status -eq 0 ]] && status=$rc
    return 0
}

before_python() {  # before_python ARGS...: python on the checkout in $before (BEFORE_ROOT):
    # it comes first on the path and -P keeps the current folder (this tree) off it, so
    # `-m benchmarks.NAME` runs that checkout's own script on its own package
    env PYTHONPATH="$before:$PYTHONPATH" "$python" -P "$@"
}

latency() {  # latency TAG "CONCURRENCIES" [SERVER FLAG...]: `octavo bench serve` at each
    # concurrency (8 requests per stream, 32 prompt and 128 output tokens) against one
    # GPT-2 small server started with the flags
    local tag=$1 concurrencies=$2 port=8765 model server concurrency
    shift 2
    model=$(mktemp -d)/model
    "$python" -c "import sys; from pathlib import Path
from benchmarks import serving_throughput as s
s.write_model(Path(sys.argv[1]), s.parse_args(['--preset', 'gpt2']))" "$model"
    "$python" -m octavo serve --model "$model" --load-format dummy --device cuda \
        --dtype float16 --port $port --log-level warning "$@" >"$out/server_$tag.log" 2>&1 &
    server=$!
    # The GPU image has no curl.
    "$python" - "$port" <<'PY'
import sys
import time
import urllib.request

for _ in range(120):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2)
        break
    except OSError:
        time.sleep(1)
PY
    for concurrency in $concurrencies; do
        step "latency_${tag}_c$concurrency" "$python" -m octavo bench serve \
            --base-url "http://127.0.0.1:$port" --random-input-len 32 --random-output-len 128 \
            --num-prompts $((concurrency * 8)) --max-concurrency "$concurrency" --ignore-eos \
            --no-progress --result-file "$out/latency_${tag}_c$concurrency.json"
    done
    kill "$server"
    wait "$server"
}

gpu_tests() {  # gpu_tests NAME PYTEST_ARGS...: the GPU-marked tests under the arguments,
    # eight workers at once, then those marked gpu_memory one at a time (under eight workers
    # they run out of memory or size their cache from what the others left)
    local name=$1
    shift
    step "$name" "$python" -m pytest -v -n 8 -m "gpu and not gpu_memory" "$@" \
        -p no:cacheprovider --timeout 300
    step "${name}_memory" "$python" -m pytest -v -m "gpu and gpu_memory" "$@" \
        -p no:cacheprovider --timeout 300
}

case $stage in
tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    "$python" -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$out/gpu.txt"
    gpu_tests gpu_tests tests/kernels tests/engine
    # The CPU engine suite (models included) as it is, every engine moved to CUDA (float32 kept):
    # GPT-2 variants and GPTBigCode (multi-query kernels), CUDA graphs,
    # pinned copies and one-step-ahead scheduling against the same HF oracle.
    # Eight workers (pytest-xdist is on the GPU image; the machine has 16 cores): one after
    # another the tests take longer than a 10-minute call, most of it Triton compiling each
    # test's shapes. -v names each test as it ends; CUDA_SUITE_LIMIT_S (seconds) interrupts the
    # run with SIGINT, on which pytest still prints its summary of the failures so far.
    step engine_suite_on_cuda timeout --signal INT --kill-after 30 "${CUDA_SUITE_LIMIT_S:-540}" \
        "$python" -m pytest -v -rf -n 8 tests/engine -m "not gpu" \
        --engine-device cuda -p no:cacheprovider --timeout 300
    ;;
kernels)
    step kernel_bench "$python" -m benchmarks.kernel_bench --sweep --result-file "$out/kernel_bench.json"
    ;;
engine)
    step step_latency "$python" -m benchmarks.step_latency --device cuda --dtype float16 \
        --result-file "$out/step_latency.json"
    step beam_bench "$python" -m benchmarks.beam_bench --device cuda --dtype float16 \
        --preset gpt2 --result-file "$out/beam_bench.json"
    # One-step-ahead scheduling is the CUDA default; each measurement also runs without it.
    step profile_decode "$python" -m benchmarks.profile_decode --device cuda --dtype float16 \
        --preset gpt2 --result-file "$out/profile_decode.json" --trace-dir "$out/traces"
    step profile_decode_sync "$python" -m benchmarks.profile_decode --device cuda \
        --dtype float16 --preset gpt2 --no-async-scheduling \
        --result-file "$out/profile_decode_sync.json"
    step host_overhead "$python" -m benchmarks.host_overhead --device cuda \
        --engine-args '{"async_scheduling": true}' --result-file "$out/host_overhead.json"
    step host_overhead_sync "$python" -m benchmarks.host_overhead --device cuda \
        --engine-args '{"async_scheduling": false}' --result-file "$out/host_overhead_sync.json"
    ;;
offline)
    step offline_gpt2 "$python" -m benchmarks.offline_throughput --device cuda --dtype float16 \
        --preset gpt2 --num-requests 256 --result-file "$out/offline_gpt2.json"
    step offline_gpt2_sync "$python" -m benchmarks.offline_throughput --device cuda \
        --dtype float16 --preset gpt2 --num-requests 256 --repeats 3 --skip-hf-static \
        --skip-hf-cb --no-async-scheduling --result-file "$out/offline_gpt2_sync.json"
    step offline_gpt2_medium "$python" -m benchmarks.offline_throughput --device cuda \
        --dtype float16 --preset gpt2-medium --num-requests 256 --repeats 1 \
        --result-file "$out/offline_gpt2_medium.json"
    ;;
serve)
    # 256 streams of short prompts, 64-128 tokens each, EOS ignored: offline and served on
    # the same requests, four client processes so the client is not the bottleneck. 4096
    # requests, 256 running at a time: 1024 took 0.8-1.4 s a run on an H200, and two runs of
    # one mode differed by more than two modes did.
    # With py-spy (carried as a wheel, its binary on the PATH), every server process's stacks
    # in each mode's first timed run: the core spins on CUDA events, so its CPU time alone
    # cannot tell its work from its waiting.
    stacks=()
    command -v py-spy >/dev/null && stacks=(--py-spy-dir "$out/stacks")
    step serving_gpt2 "$python" -m benchmarks.serving_throughput --preset gpt2 --device cuda \
        --dtype float16 --num-requests 4096 --modes streamed unstreamed interval8 api2 \
        --client-procs 4 --repeats 3 "${stacks[@]}" --result-file "$out/serving_throughput_gpt2.json"
    # How soon the same burst reaches a server that does nothing: the served runs' floor.
    step burst_floor_gpt2 "$python" -m benchmarks.burst_floor --preset gpt2 \
        --num-requests 4096 --client-procs 4 --result-file "$out/burst_floor_gpt2.json"
    # Latency at 1-64 concurrent streams against one server (`octavo bench serve`).
    latency default "1 4 16 64"
    ;;
served_loss)
    # The serve stage's workload at the defaults, 4096 requests, streamed and unstreamed, with
    # py-spy's stacks (carried as a wheel) of every server process in each mode's first timed
    # run and of the benchmark's own process throughout: its offline `LLM.generate` is the
    # same engine without the server, so the two profiles tell what serving adds to a step.
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    "$python" -m pip list 2>/dev/null | grep -iE "^(vllm|sglang) " | tee -a "$out/gpu.txt"
    step serving_gpt2 py-spy record --idle --nonblocking --format raw --rate 200 \
        --output "$out/stacks_offline.txt" -- "$python" -m benchmarks.serving_throughput \
        --preset gpt2 --device cuda --dtype float16 --num-requests 4096 \
        --modes streamed unstreamed --client-procs 4 --repeats 2 --py-spy-dir "$out/stacks" \
        --result-file "$out/serving_throughput_gpt2.json"
    # One stream's first token against its parts and against the engine alone.
    step first_token "$python" -m benchmarks.first_token --device cuda --dtype float16 \
        --preset gpt2 --num-requests 32 --result-file "$out/first_token_gpt2.json"
    ;;
served_loss_compare)
    before=${BEFORE_ROOT:?served_loss_compare needs BEFORE_ROOT, the checkout to measure against}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    # The engine core is one host-bound thread: how much slower it runs while other
    # processes keep the host's other CPUs busy (the served runs' API processes and
    # clients do).
    (lscpu; grep -H . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list) \
        >"$out/cpu_topology.txt" 2>&1
    step cpu_contention "$python" -m benchmarks.cpu_contention --busy 0 1 3 7 15
    gpu_tests gpu_tests tests/kernels/test_gpu_kernels.py tests/engine/test_gpu_engine.py
    step serving_gpt2_compare "$python" -m benchmarks.serving_throughput --preset gpt2 \
        --device cuda --dtype float16 --num-requests 4096 --modes streamed unstreamed \
        --before-root "$before" --before-modes streamed unstreamed --client-procs 4 \
        --repeats 3 --result-file "$out/serving_throughput_gpt2_compare.json"
    for round in 1 2; do
        step "first_token_$round" "$python" -m benchmarks.first_token --device cuda \
            --dtype float16 --preset gpt2 --num-requests 32 \
            --result-file "$out/first_token_gpt2_$round.json"
        step "first_token_before_$round" before_python -m benchmarks.first_token --device cuda \
            --dtype float16 --preset gpt2 --num-requests 32 \
            --result-file "$out/first_token_gpt2_before_$round.json"
    done
    ;;
arrivals)
    # Steps under arrivals (two prompts of 24 tokens prefilled beside each step's decodes,
    # as on the serve stage's workload) do not fit the decode graphs. Profiled with
    # admissions every step and every 8th step (--prefill-interval 8, the CUDA default: 7
    # steps of 8 replay the graphs), alternated; then offline and served at interval 1
    # (the default is the serve stage's run).
    for round in 1 2; do
        for interval in 1 8; do
            step "profile_arrivals_interval${interval}_$round" "$python" \
                -m benchmarks.profile_decode --device cuda --dtype float16 --preset gpt2 \
                --batches 64 256 --arrivals 2 --prefill-interval "$interval" \
                --result-file "$out/profile_arrivals_interval${interval}_$round.json"
        done
    done
    step serving_gpt2_interval1 "$python" -m benchmarks.serving_throughput --preset gpt2 \
        --device cuda --dtype float16 --num-requests 1024 --prefill-interval 1 \
        --modes streamed unstreamed --client-procs 4 --repeats 3 \
        --result-file "$out/serving_throughput_gpt2_prefill_interval1.json"
    ;;
piecewise)
    # Steps that prefill replayed from piecewise graphs (--piecewise-cuda-graphs) against
    # eager ones: the GPU test first (HF's greedy tokens through captured pieces), then steps
    # under arrivals at --prefill-interval 1 and 8 (the CUDA default), each with and without
    # the pieces, alternated; then offline and served on the serve stage's requests, both
    # ways.
    # The kernel test covers a mixed batch's leading decodes on the decode path.
    step gpu_tests_piecewise "$python" -m pytest -v -n 4 -m gpu tests/engine/test_gpu_engine.py \
        tests/kernels/test_gpu_kernels.py -k "piecewise or real_sizes" -p no:cacheprovider \
        --timeout 300
    for interval in 1 8; do
        for mode in eager piecewise; do
            flags=(--no-piecewise-cuda-graphs)
            [[ $mode == piecewise ]] && flags=(--piecewise-cuda-graphs)
            step "profile_arrivals_interval${interval}_$mode" "$python" \
                -m benchmarks.profile_decode --device cuda --dtype float16 --preset gpt2 \
                --batches 64 256 --arrivals 2 --prefill-interval "$interval" "${flags[@]}" \
                --result-file "$out/profile_arrivals_interval${interval}_$mode.json"
        done
    done
    # py-spy (as in the serve stage) samples the server's processes in the first mode's
    # timed run: where the engine core's time goes while served throughput trails offline.
    for mode in piecewise eager; do
        flags=(--no-piecewise-cuda-graphs)
        [[ $mode == piecewise ]] && flags=(--piecewise-cuda-graphs)
        [[ $mode == piecewise ]] && command -v py-spy >/dev/null \
            && flags+=(--py-spy-dir "$out/stacks")
        step "serving_gpt2_$mode" "$python" -m benchmarks.serving_throughput --preset gpt2 \
            --device cuda --dtype float16 --num-requests 1024 --modes streamed unstreamed \
            --client-procs 4 --repeats 2 "${flags[@]}" \
            --result-file "$out/serving_throughput_gpt2_$mode.json"
    done
    # What the default interval costs a request's first token at low load: admissions wait
    # up to 8 steps while others decode.
    latency interval8 "1 4 16"
    latency interval1 "1 4 16" --prefill-interval 1
    ;;
compare)
    # Profiles first, alternated, then the tests, then a second round of profiles: a call
    # cut short at its time limit still holds one measurement of each tree.
    before=${BEFORE_ROOT:?compare needs BEFORE_ROOT, another checkout to measure against}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
    profile=(--device cuda --dtype float16 --preset gpt2 ${PROFILE_BATCHES:+--batches $PROFILE_BATCHES})
    for round in 1 2; do
        step "profile_after_$round" "$python" -m benchmarks.profile_decode "${profile[@]}" \
            --result-file "$out/profile_after_$round.json"
        step "profile_before_$round" before_python -m benchmarks.profile_decode \
            "${profile[@]}" --result-file "$out/profile_before_$round.json"
        if [[ $round -eq 1 ]]; then
            gpu_tests gpu_tests tests/kernels tests/engine
        fi
    done
    ;;
fusions)
    # A kernel change measured twice: kernel_bench in this tree and in the checkout before
    # it, then the decode step against that checkout at small batches and large ones.
    before=${BEFORE_ROOT:?fusions needs BEFORE_ROOT, the checkout to measure against}
    step kernel_bench "$python" -m benchmarks.kernel_bench --result-file "$out/kernel_bench.json"
    step kernel_bench_before before_python -m benchmarks.kernel_bench \
        --result-file "$out/kernel_bench_before.json"
    PROFILE_BATCHES="1 8 16 64 256" bash "$0" compare "$out" || status=$?
    ;;
speculative)
    for dtype in float16 float32; do
        step "speculative_$dtype" "$python" -m benchmarks.speculative_decoding --device cuda \
            --dtype "$dtype" --batch-sizes 1 8 --repeats 5 \
            --result-file "$out/speculative_decoding_$dtype.json"
    done
    ;;
lora)
    step lora_tests "$python" -m pytest -v -rf -n 4 tests/engine/worker/test_lora.py tests/kernels/test_lora_kernel.py \
        --engine-device cuda -p no:cacheprovider --timeout 300
    step lora_bench "$python" -m benchmarks.lora_bench --device cuda --dtype float16 --preset gpt2 \
        --batch 256 --repeats 5 --result-file "$out/lora_bench_gpt2.json"
    ;;
serve_compare)
    # One offline run, then both trees' servers on the same requests, streamed and
    # unstreamed, one mode after another: a serving change against the commit before it.
    # 1024 requests, so that four modes fit the call.
    before=${BEFORE_ROOT:?serve_compare needs BEFORE_ROOT, the checkout to measure against}
    step serving_gpt2_compare "$python" -m benchmarks.serving_throughput --preset gpt2 \
        --device cuda --dtype float16 --num-requests 1024 --modes streamed unstreamed \
        --before-root "$before" --before-modes streamed unstreamed --client-procs 4 \
        --repeats 3 --result-file "$out/serving_throughput_gpt2_compare.json"
    # How soon the same burst reaches a server that does nothing: the served runs' floor.
    step burst_floor_gpt2 "$python" -m benchmarks.burst_floor --preset gpt2 \
        --num-requests 1024 --client-procs 4 --result-file "$out/burst_floor_gpt2.json"
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
exit $status
