"""The tests run lowering pipelines through `passes.manager` directly, so they wire the built-in kernel
targets in first, as the tools do (`sexpgpu.targets`)."""

from sexpgpu.targets import register_targets

register_targets()
