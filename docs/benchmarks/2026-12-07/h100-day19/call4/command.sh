# call 4 (held): b7fd449 with schedules/direct-hybrid.yaml edited to cpu_wait: device (what auto runs since)
export LIMIT=250; set -uo pipefail; ROOT=/tmp/r4; mkdir -p $ROOT; T0=$(date +%s); trap 'tar czf $OUT/results.tgz -C $ROOT .' EXIT
eval "$(sed -n '53,90p' .ci/gpu-day)"; export WHEELS=.whl-tf; source .ci/gpu-env; M=/tmp/store/nemotron-3-nano-30b-a3b; G=/tmp/gguf/nemotron-3-nano-30b-a3b.gguf
b 8g-uniform-auto-device 8GiB uniform /tmp/pkg --schedule auto
b 8g-skewed-auto-device 8GiB skewed /tmp/pkg --schedule auto
b 8g-uniform-auto-device-2 8GiB uniform /tmp/pkg --schedule auto
