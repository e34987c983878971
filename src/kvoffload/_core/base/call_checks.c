/* The common case of a call's argument check, at C speed: a plain dict of native keys to block ids.
 *
 * block_mapping(blocks, num_blocks, unique) returns a copy of ``blocks`` when it is exactly a dict
 * whose keys are bytes, str, int or bool, or tuples of them (one level), and whose values are exact
 * ints in [0, num_blocks), distinct if ``unique``; else None, and the caller's Python check (which
 * takes any mapping, nested tuples, integer-likes, and words every refusal) decides. Nothing here
 * raises for a bad argument, so the messages live in one place. No key is hashed, no caller code
 * runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>

static int native_part(PyObject *o)
{
    return PyBytes_CheckExact(o) || PyUnicode_CheckExact(o) || PyLong_CheckExact(o) || PyBool_Check(o);
}

static int native_key(PyObject *k)
{
    if (native_part(k)) {
        return 1;
    }
    if (!PyTuple_CheckExact(k)) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(k); i++) {
        if (!native_part(PyTuple_GET_ITEM(k, i))) {
            return 0;
        }
    }
    return 1;
}

static int by_value(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* 1 if two of the n ids are equal, else 0 (sorts them when there are more than 16). */
static int has_duplicates(long long *ids, Py_ssize_t n)
{
    if (n <= 16) {
        for (Py_ssize_t i = 1; i < n; i++) {
            for (Py_ssize_t j = 0; j < i; j++) {
                if (ids[i] == ids[j]) {
                    return 1;
                }
            }
        }
        return 0;
    }
    qsort(ids, (size_t)n, sizeof *ids, by_value);
    for (Py_ssize_t i = 1; i < n; i++) {
        if (ids[i] == ids[i - 1]) {
            return 1;
        }
    }
    return 0;
}

PyDoc_STRVAR(block_mapping_doc,
"block_mapping(blocks, num_blocks, unique, /) -> dict | None\n\n"
"A copy of ``blocks`` if it is exactly a dict of native keys (bytes, str, int, bool, or tuples of\n"
"them) to exact ints in [0, num_blocks), distinct if ``unique``; else None (the caller checks).");

static PyObject *block_mapping(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "block_mapping takes 3 arguments");
        return NULL;
    }
    PyObject *blocks = args[0];
    long long num_blocks = PyLong_AsLongLong(args[1]);
    if (num_blocks == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int unique = PyObject_IsTrue(args[2]);
    if (unique < 0) {
        return NULL;
    }
    if (!PyDict_CheckExact(blocks)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyDict_GET_SIZE(blocks);
    long long small[16];
    long long *ids = small;
    if (unique && n > 16 && (ids = PyMem_Malloc((size_t)n * sizeof *ids)) == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *key, *value, *out;
    Py_ssize_t pos = 0, i = 0;
    while (PyDict_Next(blocks, &pos, &key, &value)) {
        int overflow = 0;
        long long id = PyLong_CheckExact(value) ? PyLong_AsLongLongAndOverflow(value, &overflow) : -1;
        if (!native_key(key) || overflow || id < 0 || id >= num_blocks) {
            goto done; /* the Python check decides (and words the refusal) */
        }
        if (unique) {
            ids[i++] = id;
        }
    }
    if (unique && has_duplicates(ids, n)) {
        goto done;
    }
    out = PyDict_Copy(blocks);
    if (ids != small) {
        PyMem_Free(ids);
    }
    return out;
done:
    if (ids != small) {
        PyMem_Free(ids);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"block_mapping", (PyCFunction)(void (*)(void))block_mapping, METH_FASTCALL, block_mapping_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload._core.base.call_checks",
    .m_doc = "The common case of a call's argument check, at C speed.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit_call_checks(void)
{
    return PyModule_Create(&module);
}
