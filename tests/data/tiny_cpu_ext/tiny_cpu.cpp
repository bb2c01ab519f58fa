// Tiny C++ extension (no CUDA, no torch headers, so it compiles in about a second) used only by
// tests/test_kernels_build.py to exercise the JIT loader end to end on a CPU machine.
#include <Python.h>

#include <sstream>

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

// format_int(n) = str(n) through std::ostringstream: crashes when the extension carries its own static
// libstdc++ beside the process's shared one (their locale facets disagree; docs/kernels.md §11).
static PyObject* format_int(PyObject*, PyObject* args) {
    long long n;
    if (!PyArg_ParseTuple(args, "L", &n)) return nullptr;
    std::ostringstream ss;
    ss << n;
    return PyUnicode_FromString(ss.str().c_str());
}

static PyMethodDef methods[] = {
    {"add_scaled", add_scaled, METH_VARARGS, "a + alpha * b"},
    {"format_int", format_int, METH_VARARGS, "str(n) via std::ostringstream"},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, TWELL_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};

PyMODINIT_FUNC TWELL_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
