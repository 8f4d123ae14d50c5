# call 5 (held), b7fd449 with direct-hybrid.yaml as in call 4
export LIMIT=170; set -uo pipefail; ROOT=/tmp/r5; mkdir -p $ROOT; T0=$(date +%s); trap 'tar czf $OUT/results.tgz -C $ROOT .' EXIT
eval "$(sed -n '53,90p' .ci/gpu-day)"; export WHEELS=.whl-tf; source .ci/gpu-env; M=/tmp/store/nemotron-3-nano-30b-a3b; G=/tmp/gguf/nemotron-3-nano-30b-a3b.gguf
BT=140 b 8g-pc-profile 8GiB skewed /tmp/pkg --schedule direct:h2d.prompt_cpu=-1 --prompt-lengths 512 --decode-tokens 8 --profile
