"""Small building blocks shared by the model: RMSNorm and interleaved partial RoPE (+ YaRN)."""
