# call 2 (the machine held after call 1: store and llama.cpp build kept), the same tree (b7fd449)
export LIMIT=400; set -uo pipefail; ROOT=/tmp/r2; mkdir -p $ROOT; T0=$(date +%s); trap 'tar czf $OUT/results.tgz -C $ROOT .' EXIT
eval "$(sed -n '53,90p' .ci/gpu-day)"; export WHEELS=.whl-tf; source .ci/gpu-env; M=/tmp/store/nemotron-3-nano-30b-a3b; G=/tmp/gguf/nemotron-3-nano-30b-a3b.gguf
b 8g-uniform-auto 8GiB uniform /tmp/pkg --schedule auto      # direct-hybrid, then with cpu_wait: host (segments)
b 8g-uniform-direct 8GiB uniform /tmp/pkg
b 8g-skewed-auto 8GiB skewed /tmp/pkg --schedule auto
timeout 90 /tmp/peer/lb/bin/llama-bench -m $G -ngl 99 -fa on -t 16 -ncmoe 44 -lm none -p 0 -n 32 -r 3
b 8g-uniform-auto-2 8GiB uniform /tmp/pkg --schedule auto
