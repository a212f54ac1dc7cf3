"""The DeepSeek-V4 model as nn.Modules (full-sequence path with autograd) and its checkpoint I/O."""
