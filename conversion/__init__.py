"""Architecture-agnostic HF <-> Megatron conversion engine and the `modelzoo` command (installed as
`modelzoo.conversion`)."""
