// Precompiled header for the translation units that use LibTorch. LibTorch's
// headers dominate their compile time; compiled once per target instead.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn.h>
#include <torch/optim.h>
#include <torch/types.h>
