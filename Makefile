# The two commands: `make demo` and `make test`. Everything else is a helper for them.
SHELL := /bin/bash
export SCD_MODEL_DIR ?= $(CURDIR)/.cache/models
export SCD_DATA_DIR ?= $(CURDIR)/.cache/data

.PHONY: demo test soak test-amx test-avx512bf16 test-avx512f test-avx2 test-netns test-smoke setup model data build lint fmt bench

setup:
	ops/setup.sh

model:
	ops/fetch-model.sh

data:
	ops/fetch-corpora.sh

build: setup
	cargo build --release

demo: setup model build
	@echo "== the base model =="
	target/release/scd generate --model $(SCD_MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf \
		--prompt "In one sentence, what is a cache?" --max-tokens 48
	@echo "== the melville expert (base + LoRA trained on Moby Dick), same base weights =="
	target/release/scd generate --model $(SCD_MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf \
		--adapter experts/melville/adapter.safetensors \
		--prompt "Describe the sea in two sentences." --max-tokens 48
	@echo "== the cluster: a producer node and a node with the mail-rope expert (mail, its own RoPE base: raw KV breaks) in one process, every transfer mode =="
	target/release/scd demo --model $(SCD_MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf \
		--expert mail-rope --prompt-file ops/demo-mail.txt --max-tokens 48 \
		--document-files ops/demo-documents/maintenance.txt,ops/demo-documents/contacts.txt \
		--question-file ops/demo-documents/question.txt

# The fuzz crate is its own workspace (see its Cargo.toml): checking it is what keeps it from
# rotting; building it would compile every dependency again without optimisation.
# Tests that need something this machine may lack are ignored by a plain `cargo test`; `make
# test` runs each group below where the machine has what it needs, and says plainly where not.
test: setup model data
	cargo test --workspace --all-targets --no-fail-fast
	$(call cpu_feature_tests,amx,amx_tile,AMX, (the prefill runs on f32 here))
	$(call cpu_feature_tests,avx512bf16,avx512f avx512bw avx512vl avx512_bf16 f16c,AVX-512 BF16, (decode takes the integer products here))
	$(call cpu_feature_tests,avx512f,avx512f,AVX-512F, (attention runs on the AVX2 or plain kernels here))
	$(call cpu_feature_tests,avx2,avx2 fma f16c,AVX2, with FMA and F16C)
	@if why=$$(ops/netns-link.sh check 2>&1); then $(MAKE) --no-print-directory test-netns; \
	else echo "netns tests not run: needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2 (ip, tc): $${why#netns-link: }"; fi
	cargo check --manifest-path transport/fuzz/Cargo.toml --no-default-features --target-dir target/fuzz-check
	$(MAKE) --no-print-directory test-deploy

# The control plane's soak (minutes, so not part of `make test`): a real etcd
# compacting every minute, over 10 MiB of finished job records in the live prefix, then 2,000
# small jobs through a scheduler and simulated nodes. It prints jobs/s, the live and archived
# records and etcd's database size every 5 s; BENCHMARKS.md records a run.
soak: setup
	cargo test -p scd-scheduler --test integration -- --ignored --nocapture soak::

# $(call cpu_feature_tests,GROUP,FLAGS,NAME[,NOTE]): `make test-GROUP` where /proc/cpuinfo lists
# every one of FLAGS, else a line saying that the NAME tests did not run and why.
cpu_feature_tests = @if (for f in $(2); do grep -qw "$$f" /proc/cpuinfo || exit 1; done) 2>/dev/null; \
	then $(MAKE) --no-print-directory test-$(1); \
	else echo "$(3) tests not run: this CPU has no $(3)$(4)"; fi

# The tests that need a CPU feature, one group each, named so that one filter selects it and
# ignored by a plain `cargo test`; `make test` runs each where the CPU has the feature.
# Elsewhere they fail, saying what the CPU lacks.
# The AMX prefill and tile products (`*_on_amx_tiles`).
test-amx: setup model data
	cargo test --workspace --all-targets --no-fail-fast -- --ignored on_amx_tiles

# Decode on AVX-512 BF16's dot products (`*_on_avx512bf16`).
test-avx512bf16: setup model data
	cargo test --workspace --all-targets --no-fail-fast -- --ignored on_avx512bf16

# The AVX-512F attention and decode kernels on their own (`*_on_avx512f`).
test-avx512f: setup
	cargo test --workspace --all-targets --no-fail-fast -- --ignored on_avx512f

# The AVX2 attention kernels on their own (`*_on_avx2`).
test-avx2: setup
	cargo test --workspace --all-targets --no-fail-fast -- --ignored on_avx2

# A transfer across two network namespaces joined by a veth link shaped with tc
# (transport/tests/netns.rs, ops/netns-link.sh): it needs root (or CAP_SYS_ADMIN and
# CAP_NET_ADMIN) and iproute2; `make test` runs it where `ops/netns-link.sh check` passes.
test-netns: setup
	cargo test -p scd-transport --test netns --no-fail-fast -- --ignored

# The deployment kit, offline (docs/deploy.md): hadolint on the Dockerfile, the compose file
# against the Compose Specification's schema, every ops/k8s overlay rendered by kubectl
# kustomize and validated against Kubernetes' schemas and the vendored CRD schemas, the
# dashboard and scrape configs (ops/validate-deploy.py; a few seconds). The node side of the
# kit (the probes, the dashboard's series in live scrapes, the k8s node configs) is
# actors/tests/integration/deploy.rs, part of `cargo test`.
.PHONY: test-deploy
test-deploy: setup
	.cache/openai-venv/bin/python ops/validate-deploy.py

# One run of each command that `make demo` and the documents use, with the tiniest settings
# (tests/cli_smoke.rs; part of `make test`).
test-smoke: setup model data
	cargo test -p scd --test cli_smoke --no-fail-fast

# The control plane under faults (minutes, so not part of `make test`): a
# real etcd with a scheduler, a producer and a consumer node running the real model, jobs in
# flight; the consumer killed and restarted under its id at once; etcd stopped 60 s
# (SIGSTOP); etcd out of space (NOSPACE under a 16 MiB --quota-backend-bytes, held 20 s, then
# healed); the producer and the consumer partitioned from each other 60 s; the consumer cut
# from etcd 60 s. The last two put the producer and the consumer in network namespaces
# (ops/netns-link.sh: root, or CAP_SYS_ADMIN and CAP_NET_ADMIN) and fail saying so without.
# Each prints a row of submitted / done / failed / lost / duplicated / retries / seconds to
# recover; BENCHMARKS.md records a run. The restart tests of `make test`
# (actors/tests/failpoints/restarts.rs, scheduler/tests/integration/restarts.rs) check single jobs through restarts.
.PHONY: faults
faults: setup model data
	cargo test -p scd-actors --test failpoints -- --ignored --nocapture --test-threads 1 faults::

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

fmt:
	cargo fmt --all

# llama.cpp (llama-cpp-python) in its own environment: the reference of the model-parity fixture
# and the baseline of `scd bench model`. Neither the build nor the tests need it.
export SCD_LLAMA_VENV ?= $(CURDIR)/.cache/llama-cpp
.PHONY: llama-cpp llama-parity-fixture bench-model

llama-cpp:
	ops/install-llama-cpp.sh

# Regenerates models/tests/fixtures/llama_parity.{json,bin} (models/tests/llama_parity.rs).
llama-parity-fixture: llama-cpp model
	$(SCD_LLAMA_VENV)/bin/python ops/llama-parity-fixture.py

# scd, candle-transformers' quantized llama and llama.cpp, same protocol, same run.
bench-model: model build
	target/release/scd bench model --model $(SCD_MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf \
		--llama-python $(SCD_LLAMA_VENV)/bin/python

# The transport's open-ended fuzz run (cargo-fuzz, libFuzzer with AddressSanitizer) of the
# receiver's path, the same function `cargo test` runs bounded (transport/tests/fuzz_receive.rs).
# cargo-fuzz needs nightly features; RUSTC_BOOTSTRAP=1 unlocks them on the stable toolchain.
# New inputs go to transport/fuzz/corpus (not checked in); the checked-in seeds are read only.
# A crash lands in transport/fuzz/artifacts: copy it into transport/fuzz/seeds/receive_path.
FUZZ_SECS ?= 600
.PHONY: fuzz
fuzz:
	command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	mkdir -p transport/fuzz/corpus/receive_path
	cd transport/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run receive_path \
		corpus/receive_path seeds/receive_path -- -max_total_time=$(FUZZ_SECS)
