// Tiny C++ extension (no CUDA, no torch headers, so it compiles in about a second) used only by
// tests/test_kernels_build.py to exercise the JIT loader end to end on a CPU machine.
#include <Python.h>

#define TWELL_CAT2(a, b) a##b
#define TWELL_CAT(a, b) TWELL_CAT2(a, b)
#define TWELL_STR2(a) #a
#define TWELL_STR(a) TWELL_STR2(a)

// add_scaled(a, b, alpha) = a + alpha * b on Python floats.
static PyObject* add_scaled(PyObject*, PyObject* args) {
    double a, b, alpha;
    if (!PyArg_ParseTuple(args, "ddd", &a, &b, &alpha)) return nullptr;
    return PyFloat_FromDouble(a + alpha * b);
}

static PyMethodDef methods[] = {
    {"add_scaled", add_scaled, METH_VARARGS, "a + alpha * b"},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, TWELL_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};

PyMODINIT_FUNC TWELL_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
