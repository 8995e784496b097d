"""The one model-parallel composition: pipeline stages, tensor parallelism inside each, a data-parallel
strategy over them (what each file holds: docs/architecture.md, section "Model strategies"; the
classes are exported from :mod:`dtlab.models`)."""
