// Compiles torch_pch.h once; every LibTorch library and test of the trainer reuses that
// precompiled header (tessera_use_torch_pch in trainer/CMakeLists.txt).
#include "trainer/torch_pch.h"
