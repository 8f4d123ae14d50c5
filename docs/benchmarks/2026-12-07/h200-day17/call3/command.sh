# call 3 (held after call 2)
export LIMIT=300; set -uo pipefail; ROOT=/tmp/r3; mkdir -p $ROOT; T0=$(date +%s); trap 'tar czf $OUT/results.tgz -C $ROOT .' EXIT
eval "$(sed -n '53,80p' .ci/gpu-day)"; export WHEELS=.whl-tf; source .ci/gpu-env; M=/tmp/store/nemotron-3-nano-30b-a3b; G=/tmp/gguf/nemotron-3-nano-30b-a3b.gguf
timeout 60 /tmp/peer/lb/bin/llama-bench -m $G -ngl 99 -fa on -t 16 -ncmoe 44 -lm none -p 512 -n 0 -r 3 2>&1 | grep -E "\| *(tg|pp)" | cut -c90- | tee $ROOT/llama.txt
for a in 128 32 128; do BT=100 b pa$a-$RANDOM 8GiB uniform /tmp/pkg --schedule direct:h2d.prompt_ahead=$a --prompt-lengths 512,2048 --decode-tokens 4 >/dev/null; echo "ahead $a"; grep -A3 "^ *prompt " $ROOT/pa$a-*.txt | tail -2; done
el end
