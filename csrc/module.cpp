// Python module stub: importing megatron_tlt._C (or the JIT-built twin) loads this shared
// library, whose static initialisers register the torch.ops.megatron_tlt.* ops. The
// module itself has no attributes. TORCH_EXTENSION_NAME is set by torch's build tools.
#include <Python.h>

#define TLT_CAT_(a, b) a##b
#define TLT_CAT(a, b) TLT_CAT_(a, b)
#define TLT_STR_(a) #a
#define TLT_STR(a) TLT_STR_(a)

extern "C" PyMODINIT_FUNC TLT_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      TLT_STR(TORCH_EXTENSION_NAME),
      "megatron_tlt compiled ops; use torch.ops.megatron_tlt (registered on import).",
      -1,
      nullptr,
  };
  return PyModule_Create(&module_def);
}
