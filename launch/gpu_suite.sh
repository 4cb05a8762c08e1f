#!/usr/bin/env bash
# The project's GPU checks and benchmarks on the GPUs of one node, every output in OUTDIR:
#
#   launch/gpu_suite.sh OUTDIR [STEP ...]     (NPROC=n: ranks; default every GPU)
#
# Steps (default: all, in this order): peer_check overlap_check moe_check (the peer MoE layout, its
# refusals and the pipeline by source against a float64 MoE) moe_overlap_check (micro-batches, soaks
# eager and from graphs, the FP8 kernels) norm_check (the fused all-reduce + RMSNorm kernels)
# tile_signal_check (the tile-signalled GEMM + reduce-scatter / all-reduce) compile_check (the torch.ops.commops ops compiled, reduce-overhead and CUDA graphs; one GPU
# suffices) compile_peer (the operators over peer memory compiled and captured, and the compiled
# MLP step timed beside the eager one) faults overlap_tune overlap_tune_graph overlap overlap_graph tp_mlp norm (the fused
# all-reduce + RMSNorm beside the three steps, decode sizes, eager and graphs) tile_gemm (the
# tile-signalled GEMM against cuBLAS on one GPU, with copies beside it) moe peer_bench
# peer_big tune_peer (host cost per call, with a profile); and, only when named: sanitize (the peer-memory checks and
# tests/gpu_sanitize_cases.py under compute-sanitizer's memcheck and racecheck), moe_pipeline (the MoE
# pipelines, by token chunks and by source rank, where the exchange is closest to the experts),
# moe_auto (chunks="auto" following the table moe and moe_pipeline wrote),
# topology (python -m topology), a2a_bench (NCCL's
# and our all-to-all algorithms, 8 B - 1 GB, eager and graphs), hf_model (launch/bench_model.py: a
# Llama-3-8B-like and a Qwen3-30B-A3B-like model of 4 layers, ours against transformers' own
# parallelism, training, prefill 2K-16K and decode 1-64, tokens and losses compared; hf_dense and
# hf_moe: one family each), zoo_check (tests/gpu_models_check.py: the model zoo's subset, decode eager
# and from CUDA graphs, at N ranks and at 2 sharing one GPU), hf_plans (launch/bench_model.py on
# DeepSeek-V3-, GPT-OSS- and Qwen2-like models sharded from their plans), fp8_experts (the FP8 experts'
# kernels checked, then launch/bench_experts.py --fp8), peer_epilogue (GEMMs writing
# into a peer's memory against GEMMs beside a copy engine) and model (a calibration of this
# machine, then the cost model's predictions against peer_bench's and a2a_bench's measurements,
# which run first). On 4 or 8 GPUs: NPROC=n launch/gpu_suite.sh OUT peer_check overlap_check
# moe_check topology peer_bench a2a_bench model overlap moe.
# Each runs under a time limit and writes STEP.log (and its JSON/plots; the four check steps
# write their checks' counts and failures by family, tests/_checks.py); a failing step does not
# stop the others. NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
set -u
OUT=${1:?usage: launch/gpu_suite.sh OUTDIR [STEP ...]}
shift
STEPS=${*:-peer_check overlap_check moe_check moe_overlap_check norm_check tile_signal_check compile_check compile_peer faults overlap_tune overlap_tune_graph overlap overlap_graph tp_mlp norm tile_gemm moe peer_bench peer_big tune_peer}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
N=${NPROC:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
R="python3 -m torch.distributed.run --standalone --nproc-per-node $N"
# the tensor-parallel MLP's GEMMs (Llama-3-8B-like, TP=2; bench_tp_mlp's gated MLP: gate and up in
# one column layer): all-gather + GEMM and GEMM + reduce-scatter
MLP_AG="2048x4096x14336,4096x4096x14336,8192x4096x14336,16384x4096x14336"
MLP_RS="2048x7168x4096,4096x7168x4096,8192x7168x4096,16384x7168x4096"
TUNED="$OUT/overlap_tuned.json"
MOE_TUNED="$OUT/moe_tuned.json"  # forward_pipelined(chunks="auto")'s table, from the moe and moe_pipeline steps
# the overlap steps: peer buffers large enough for the copy-engine strategy to keep its chunk
# counts at these shapes (the checks and the collectives benchmark keep the default)
BIG=${OVERLAP_PEER_BYTES:-1073741824}

run() {  # run NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  grep -v "Warning\|warn(\|^\*\*\*\|OMP_NUM_THREADS" "$OUT/$name.log" | tail -n 40
}

for step in $STEPS; do
  case $step in
    peer_check) run peer_check 300 $R tests/gpu_peer_check.py --json "$OUT/peer_check.json" ;;
    overlap_check) run overlap_check 300 $R tests/gpu_overlap_check.py --json "$OUT/overlap_check.json" ;;
    moe_check) run moe_check 300 $R tests/gpu_moe_sources_check.py --json "$OUT/moe_check.json" ;;
    moe_overlap_check) run moe_overlap_check 300 $R tests/gpu_moe_overlap_check.py --json "$OUT/moe_overlap_check.json" ;;
    norm_check) run norm_check 300 $R tests/gpu_norm_check.py --json "$OUT/norm_check.json" ;;
    tile_signal_check) run tile_signal_check 300 $R tests/gpu_tile_signal_check.py --json "$OUT/tile_signal_check.json" ;;
    tile_gemm) run tile_gemm 300 python3 -m torch.distributed.run --standalone --nproc-per-node 1 launch/probe_tile_gemm.py \
        --json "$OUT/tile_gemm.json" --plot "$OUT/tile_gemm.png" ;;
    norm) run norm 240 $R launch/bench_norm.py --json "$OUT/norm.json" --plot "$OUT/norm.png" ;;
    compile_check) run compile_check 300 $R tests/gpu_compile_check.py --json "$OUT/compile_check.json" ;;
    compile_peer) run compile_peer 300 $R tests/gpu_compile_peer_check.py --json "$OUT/compile_peer.json" \
        --time "$OUT/compile_peer_time.json" ;;
    faults) run faults 300 python3 launch/faults/run_all.py --gpu --timeout 10 --json "$OUT/faults_gpu.json" ;;
    overlap_tune)
      rm -f "$TUNED"
      COMMOPS_PEER_BYTES=$BIG run overlap_tune 240 $R launch/bench_overlap.py --ops all -n 10 -r 5 --chunks 2,4 --tune "$TUNED"
      COMMOPS_PEER_BYTES=$BIG run overlap_tune_mlp_ag 150 $R launch/bench_overlap.py --ops all_gather_gemm --shapes "$MLP_AG" -n 5 -r 5 \
        --chunks 2,4 --tune "$TUNED"
      COMMOPS_PEER_BYTES=$BIG run overlap_tune_mlp_rs 150 $R launch/bench_overlap.py --ops gemm_reduce_scatter --shapes "$MLP_RS" -n 5 -r 5 \
        --chunks 2,4 --tune "$TUNED" ;;
    overlap_tune_graph)  # entries that `auto` follows while a CUDA graph is being captured
      COMMOPS_PEER_BYTES=$BIG run overlap_tune_graph 240 $R launch/bench_overlap.py --ops all -n 10 -r 5 --chunks 2,4 --graph \
        --tune "$TUNED" ;;
    overlap) COMMOPS_PEER_BYTES=$BIG COMMOPS_OVERLAP_TUNED=$TUNED run overlap 240 $R launch/bench_overlap.py --ops all -n 10 -r 5 --chunks 2,4 \
        --json "$OUT/overlap.json" --plot "$OUT/overlap.png" ;;
    overlap_graph) COMMOPS_PEER_BYTES=$BIG COMMOPS_OVERLAP_TUNED=$TUNED run overlap_graph 240 $R launch/bench_overlap.py --ops all -n 10 -r 5 --chunks 2,4 --graph \
        --json "$OUT/overlap_graph.json" --plot "$OUT/overlap_graph.png" ;;
    tp_mlp) COMMOPS_PEER_BYTES=$BIG COMMOPS_OVERLAP_TUNED=$TUNED run tp_mlp 240 $R launch/bench_tp_mlp.py \
        --variants sequential,chunked/2,copy_engine/2,copy_engine/4,auto --json "$OUT/tp_mlp.json" --plot "$OUT/tp_mlp.png" ;;
    moe) run moe 300 $R launch/bench_moe.py --pieces 1 --chunks 2,sources,micro2 -n 10 -r 5 --json "$OUT/moe.json" \
      --csv "$OUT/moe.csv" --plot "$OUT/moe.png" --tune "$MOE_TUNED" ;;
    moe_pipeline)  # the pipelines on the peer transport, where the exchange is closest to the experts
      run moe_pipeline 300 $R launch/bench_moe.py --transport peer --chunks 2,sources,micro2 --pipeline-transfers auto \
        -n 10 -r 5 --config qwen3-30b-prefill:8192:2048:768:$((16 * N)):8 \
        --config top2-h4096-f512:16384:4096:512:$((16 * N)):2 --config top1-h4096-f1024:16384:4096:1024:$((8 * N)):1 \
        --json "$OUT/moe_pipeline.json" --csv "$OUT/moe_pipeline.csv" --plot "$OUT/moe_pipeline.png" \
        --tune "$MOE_TUNED" ;;
    moe_auto)  # chunks="auto" following the table the two steps above wrote, paired with the sequential forward:
      # the moe step's configurations over both transports, then the pipeline step's over peer
      COMMOPS_OVERLAP_TUNED=$MOE_TUNED run moe_auto_builtin 300 $R launch/bench_moe.py --pieces 1 --chunks auto -n 10 -r 5 \
        --json "$OUT/moe_auto_builtin.json" --csv "$OUT/moe_auto_builtin.csv" --plot "$OUT/moe_auto_builtin.png"
      COMMOPS_OVERLAP_TUNED=$MOE_TUNED run moe_auto 300 $R launch/bench_moe.py --transport peer --chunks auto \
        --pipeline-transfers copy_engine -n 10 -r 5 --config qwen3-30b-prefill:8192:2048:768:$((16 * N)):8 \
        --config top2-h4096-f512:16384:4096:512:$((16 * N)):2 --config top1-h4096-f1024:16384:4096:1024:$((8 * N)):1 \
        --json "$OUT/moe_auto.json" --csv "$OUT/moe_auto.csv" --plot "$OUT/moe_auto.png" ;;
    peer_bench) run peer_bench 300 $R launch/bench_collectives.py --op all_reduce,reduce_scatter,all_gather -d bf16 \
        -b 8 -e 1G -f 4 -a native,one_shot,two_shot,copy_engine,auto,symm_mem_one_shot,symm_mem_two_shot -G both -n 20 -r 5 -w 5 \
        --json "$OUT/peer.json" --plot-vs-native "$OUT/peer.png" --out none ;;
    tune_peer) run tune_peer 200 $R launch/tune_peer.py -b 8 -e 256K -f 8 --json "$OUT/tune_peer.json" ;;
    topology) run topology 60 $R -m topology --json "$OUT/topology.json" ;;
    peer_epilogue) COMMOPS_PEER_BYTES=$BIG run peer_epilogue 120 $R launch/probe_peer_epilogue.py \
        --json "$OUT/peer_epilogue.json" --plot "$OUT/peer_epilogue.png" ;;
    a2a_bench) run a2a_bench 240 $R launch/bench_collectives.py --op all_to_all -d bf16 -b 8 -e 1G -f 4 \
        -a native,pairwise,bruck,auto -G both -n 10 -r 5 -w 3 --json "$OUT/a2a.json" --plot-vs-native "$OUT/a2a.png" --out none ;;
    model)
      run calibrate 240 $R launch/calibrate.py --native --name "h200x${N}-nccl" --out "$OUT/calibration.json" \
        -b 8K -e 1G -f 4 -n 20 -r 5
      for b in peer a2a; do
        [ -f "$OUT/$b.json" ] && run "model_$b" 60 python3 launch/compare_model.py "$OUT/$b.json" \
          "$OUT/calibration.json" --md "$OUT/model_vs_measured.md" --json "$OUT/model_$b.json"
      done ;;
    sanitize)
      CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      for tool in memcheck racecheck; do
        run "sanitize_$tool" 150 $R --no-python "$CS" --tool $tool --error-exitcode 9 --target-processes all \
          python3 tests/gpu_peer_check.py --quick
        run "sanitize_cases_$tool" 150 $R --no-python "$CS" --tool $tool --error-exitcode 9 --target-processes all \
          python3 tests/gpu_sanitize_cases.py
      done ;;
    peer_big) COMMOPS_PEER_BYTES=$BIG run peer_big 240 $R launch/bench_collectives.py --op all_reduce -d bf16 \
        -b 64M -e 1G -f 2 -a native,two_shot,copy_engine -G both -n 10 -r 5 -w 3 --json "$OUT/peer_big.json" --out none ;;
    hf_model)  # both families: under 600 s each, so one call each where a call's time is bounded
      run hf_dense 540 $R launch/bench_model.py --families llama --preset llama3-8b-4l -n 5 -r 5 --out "$OUT/hf_dense"
      run hf_moe 540 $R launch/bench_model.py --families qwen3_moe --preset qwen3-30b-a3b-4l -n 5 -r 5 --out "$OUT/hf_moe" ;;
    zoo_check)
      run zoo_check 300 $R tests/gpu_models_check.py --json "$OUT/zoo_check.json" --records "$OUT/zoo_records.json"
      [ "$N" = 1 ] && run zoo_check_shared 300 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/gpu_models_check.py --json "$OUT/zoo_check_shared.json" --records "$OUT/zoo_records_shared.json" ;;
    hf_plans) run hf_plans 540 $R launch/bench_model.py --model qwen2,gpt_oss,deepseek_v3 --prefill 2048,8192 \
        --decode-batch 1,64 -n 5 -r 5 --out "$OUT/hf_plans" ;;
    fp8_experts)  # the FP8 experts' kernels against their bounds, then timed beside bf16 and torch's
      run fp8_experts_check 300 python3 -m pytest -q -m gpu tests/test_gpu_fp8_experts.py
      run fp8_experts 420 python3 launch/bench_experts.py --fp8 -n 10 -r 5 --json "$OUT/fp8_experts.json" \
        --plot "$OUT/fp8_experts.png" ;;
    hf_dense) run hf_dense 540 $R launch/bench_model.py --families llama --preset llama3-8b-4l -n 5 -r 5 --out "$OUT/hf_dense" ;;
    hf_moe) run hf_moe 540 $R launch/bench_model.py --families qwen3_moe --preset qwen3-30b-a3b-4l -n 5 -r 5 --out "$OUT/hf_moe" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
