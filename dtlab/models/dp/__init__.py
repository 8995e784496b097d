"""Data-parallel strategies: DDP, ZeRO-1/2/3 and FSDP over one data-parallel group (what each file
holds: docs/architecture.md, section "Model strategies"; the
classes are exported from :mod:`dtlab.models`)."""
