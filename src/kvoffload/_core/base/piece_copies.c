/* Copies of KV-cache pieces between cache tensors and host rows, walked in C.
 *
 * A piece is one block's bytes of one cache tensor (or of one slice of it): at
 * `base + block * stride` in the cache, at `row * slot_bytes + offset` in host memory. A
 * transfer of a few blocks of a 32-layer cache has dozens of pieces; walking them in Python
 * cost about a microsecond each (address arithmetic, a ctypes call per piece or a list per
 * descriptor). Here one call walks them all:
 *
 *   memcpy_pieces   CPU caches: one memcpy per (block, piece); the GIL released for large copies.
 *   enqueue_pieces  GPU caches: one DMA descriptor per (block, piece), given to the driver's
 *                   batched copy in one call (or cuMemcpyAsync per piece).
 *   enqueue_runs    GPU caches: one DMA descriptor per run of consecutive host rows, between
 *                   host slots and a staging buffer laid out like them.
 *   launch_pieces   GPU caches: a copy kernel's block ids written into its parameters, one
 *                   launch per MAX ids.
 *
 * The driver's entry points come as addresses (resolved by cuGetProcAddress in Python), so
 * this file needs no CUDA header or library to build, and builds and imports the same on a
 * machine without CUDA. The calls that enqueue keep the GIL: each returns in microseconds, and
 * giving the GIL up would cost a whole switch interval to get it back behind a thread busy in
 * Python; a CPU copy releases it when long enough to be worth that.
 * Addresses are trusted (the callers own the tensors and buffers); counts and integers are
 * checked.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define SMALL 64 /* sequences up to this long are converted on the stack */

typedef int (*batch_copy_fn)(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count, void *attrs,
                             size_t *attrs_idxs, size_t num_attrs, size_t *fail_idx, void *stream);
typedef int (*async_copy_fn)(uint64_t dst, uint64_t src, size_t size, void *stream);
typedef int (*launch_kernel_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                unsigned shared, void *stream, void **params, void **extra);

/* -- arguments ---------------------------------------------------------------------------- */

static int as_u64(PyObject *o, uint64_t *out, const char *what)
{
    unsigned long long v;
    if (PyLong_Check(o)) {
        v = PyLong_AsUnsignedLongLong(o);
    } else {
        PyObject *i = PyNumber_Index(o); /* numpy integers */
        if (i == NULL) {
            PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, Py_TYPE(o)->tp_name);
            return -1;
        }
        v = PyLong_AsUnsignedLongLong(i);
        Py_DECREF(i);
    }
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Format(PyExc_OverflowError, "%s must be an int in [0, 2**64)", what);
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* A sequence of non-negative ints, as uint64 (on the stack when short). */
typedef struct {
    uint64_t *v;
    Py_ssize_t n;
    uint64_t small[SMALL];
} Ints;

static void ints_free(Ints *a)
{
    if (a->v != NULL && a->v != a->small) {
        PyMem_Free(a->v);
    }
    a->v = NULL;
}

static int ints_from(PyObject *seq, Ints *out, const char *what)
{
    out->v = NULL;
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of ints");
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    out->n = n;
    out->v = n <= SMALL ? out->small : PyMem_Malloc((size_t)n * sizeof(uint64_t));
    if (out->v == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_u64(items[i], &out->v[i], what) < 0) {
            Py_DECREF(fast);
            ints_free(out);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

/* The piece table: 4 uint64 per piece (cache address of block 0, block stride, offset in a host
 * row, bytes), as any C-contiguous buffer of a multiple of 32 bytes. */
typedef struct {
    Py_buffer view;
    const uint64_t *p;
    Py_ssize_t n;
} Pieces;

static int pieces_from(PyObject *o, Pieces *out)
{
    if (PyObject_GetBuffer(o, &out->view, PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    if (out->view.len % (4 * (Py_ssize_t)sizeof(uint64_t)) != 0) {
        PyBuffer_Release(&out->view);
        PyErr_SetString(PyExc_ValueError, "the piece table must hold 4 uint64 per piece");
        return -1;
    }
    out->p = (const uint64_t *)out->view.buf;
    out->n = out->view.len / (4 * (Py_ssize_t)sizeof(uint64_t));
    return 0;
}

static int check_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

static int same_length(const Ints *ids, const Ints *rows)
{
    if (ids->n != rows->n) {
        PyErr_Format(PyExc_ValueError, "%zd block ids but %zd host rows", ids->n, rows->n);
        return -1;
    }
    return 0;
}

/* The copy functions: (cuMemcpyBatchAsync address or 0, cuMemcpyAsync address, CUmemcpyAttributes address). */
typedef struct {
    batch_copy_fn batch;
    async_copy_fn one;
    void *attrs;
} CopyFns;

static int copy_fns_from(PyObject *o, CopyFns *out)
{
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 3) {
        PyErr_SetString(PyExc_TypeError, "copy functions: a tuple (batch address, async address, attributes address)");
        return -1;
    }
    uint64_t v[3];
    for (int i = 0; i < 3; i++) {
        if (as_u64(PyTuple_GET_ITEM(o, i), &v[i], "a copy function's address") < 0) {
            return -1;
        }
    }
    if (v[0] == 0 && v[1] == 0) {
        PyErr_SetString(PyExc_ValueError, "no copy function");
        return -1;
    }
    out->batch = (batch_copy_fn)(uintptr_t)v[0];
    out->one = (async_copy_fn)(uintptr_t)v[1];
    out->attrs = (void *)(uintptr_t)v[2];
    return 0;
}

/* Descriptor arrays, on the stack when few. */
typedef struct {
    uint64_t *dst, *src;
    size_t *size;
    size_t n;
    uint64_t small_dst[SMALL], small_src[SMALL];
    size_t small_size[SMALL];
} Descriptors;

static int descriptors_init(Descriptors *d, size_t n)
{
    d->n = 0;
    if (n <= SMALL) {
        d->dst = d->small_dst, d->src = d->small_src, d->size = d->small_size;
        return 0;
    }
    d->dst = PyMem_Malloc(n * sizeof(uint64_t));
    d->src = PyMem_Malloc(n * sizeof(uint64_t));
    d->size = PyMem_Malloc(n * sizeof(size_t));
    if (d->dst == NULL || d->src == NULL || d->size == NULL) {
        PyMem_Free(d->dst), PyMem_Free(d->src), PyMem_Free(d->size);
        d->dst = NULL, d->src = NULL, d->size = NULL;
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void descriptors_free(Descriptors *d)
{
    if (d->dst != NULL && d->dst != d->small_dst) {
        PyMem_Free(d->dst), PyMem_Free(d->src), PyMem_Free(d->size);
    }
}

/* Enqueue the descriptors on `stream`: (error code, index of the copy that failed). */
static PyObject *issue(const CopyFns *fns, void *stream, Descriptors *d)
{
    int err = 0;
    size_t failed = 0;
    if (d->n > 0 && fns->batch != NULL) {
        size_t attrs_idx = 0;
        err = fns->batch(d->dst, d->src, d->size, d->n, fns->attrs, &attrs_idx, 1, &failed, stream);
    } else {
        for (size_t i = 0; i < d->n; i++) {
            err = fns->one(d->dst[i], d->src[i], d->size[i], stream);
            if (err != 0) {
                failed = i;
                break;
            }
        }
    }
    return Py_BuildValue("(in)", err, (Py_ssize_t)(err != 0 ? failed : 0));
}

/* -- memcpy_pieces -------------------------------------------------------------------------- */

PyDoc_STRVAR(memcpy_pieces_doc,
"memcpy_pieces(to_host, host_base, slot_bytes, block_ids, rows, pieces, release_gil_bytes, /) -> None\n\n"
"CPU caches: copy every piece of cache block ``block_ids[i]`` to host row ``rows[i]``\n"
"(``to_host``) or back, one memcpy per (block, piece). The GIL is released for the whole\n"
"copy when it moves at least ``release_gil_bytes`` bytes (0: never), kept otherwise.");

static PyObject *memcpy_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_nargs(nargs, 7, "memcpy_pieces") < 0) {
        return NULL;
    }
    int to_host = PyObject_IsTrue(args[0]);
    uint64_t host_base, slot_bytes, release_gil_bytes;
    if (to_host < 0 || as_u64(args[1], &host_base, "host_base") < 0 || as_u64(args[2], &slot_bytes, "slot_bytes") < 0
        || as_u64(args[6], &release_gil_bytes, "release_gil_bytes") < 0) {
        return NULL;
    }
    Ints ids, rows;
    if (ints_from(args[3], &ids, "a block id") < 0) {
        return NULL;
    }
    if (ints_from(args[4], &rows, "a host row") < 0) {
        ints_free(&ids);
        return NULL;
    }
    Pieces pieces;
    if (same_length(&ids, &rows) < 0 || pieces_from(args[5], &pieces) < 0) {
        ints_free(&ids), ints_free(&rows);
        return NULL;
    }
    uint64_t block_bytes = 0;
    for (Py_ssize_t j = 0; j < pieces.n; j++) {
        block_bytes += pieces.p[4 * j + 3];
    }
    /* Released, the copy lets the caller's event loop and other threads run meanwhile; taking the
     * GIL back may then wait a switch interval behind a thread busy in Python, which only a copy
     * much longer than that interval is worth. */
    int release = release_gil_bytes > 0 && block_bytes * (uint64_t)ids.n >= release_gil_bytes;
    PyThreadState *saved = release ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < ids.n; i++) {
        char *row = (char *)(uintptr_t)(host_base + rows.v[i] * slot_bytes);
        for (Py_ssize_t j = 0; j < pieces.n; j++) {
            const uint64_t *p = pieces.p + 4 * j;
            char *cache = (char *)(uintptr_t)(p[0] + ids.v[i] * p[1]);
            if (to_host) {
                memcpy(row + p[2], cache, (size_t)p[3]);
            } else {
                memcpy(cache, row + p[2], (size_t)p[3]);
            }
        }
    }
    if (release) {
        PyEval_RestoreThread(saved);
    }
    PyBuffer_Release(&pieces.view);
    ints_free(&ids), ints_free(&rows);
    Py_RETURN_NONE;
}

/* -- enqueue_pieces ------------------------------------------------------------------------- */

PyDoc_STRVAR(enqueue_pieces_doc,
"enqueue_pieces(copy_fns, stream, to_host, host_base, slot_bytes, block_ids, rows, pieces, first, stop, /)\n"
"    -> (error, failed_index)\n\n"
"GPU caches: enqueue on ``stream`` one DMA per (block, piece) for pieces ``[first, stop)``,\n"
"block by block, between cache blocks ``block_ids`` and host rows ``rows``. Returns the\n"
"driver's error code (0: none) and the index of the copy it failed on.");

static PyObject *enqueue_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_nargs(nargs, 10, "enqueue_pieces") < 0) {
        return NULL;
    }
    CopyFns fns;
    uint64_t stream, host_base, slot_bytes, first, stop;
    int to_host;
    if (copy_fns_from(args[0], &fns) < 0 || as_u64(args[1], &stream, "stream") < 0 || (to_host = PyObject_IsTrue(args[2])) < 0
        || as_u64(args[3], &host_base, "host_base") < 0 || as_u64(args[4], &slot_bytes, "slot_bytes") < 0
        || as_u64(args[8], &first, "first") < 0 || as_u64(args[9], &stop, "stop") < 0) {
        return NULL;
    }
    Ints ids, rows;
    if (ints_from(args[5], &ids, "a block id") < 0) {
        return NULL;
    }
    if (ints_from(args[6], &rows, "a host row") < 0) {
        ints_free(&ids);
        return NULL;
    }
    Pieces pieces;
    if (same_length(&ids, &rows) < 0 || pieces_from(args[7], &pieces) < 0) {
        ints_free(&ids), ints_free(&rows);
        return NULL;
    }
    PyObject *out = NULL;
    Descriptors d;
    if (first > stop || stop > (uint64_t)pieces.n) {
        PyErr_Format(PyExc_ValueError, "pieces [%llu, %llu) of %zd", (unsigned long long)first, (unsigned long long)stop, pieces.n);
    } else if (descriptors_init(&d, (size_t)ids.n * (size_t)(stop - first)) == 0) {
        for (Py_ssize_t i = 0; i < ids.n; i++) {
            uint64_t row = host_base + rows.v[i] * slot_bytes;
            for (uint64_t j = first; j < stop; j++) {
                const uint64_t *p = pieces.p + 4 * j;
                uint64_t cache = p[0] + ids.v[i] * p[1], host = row + p[2];
                d.dst[d.n] = to_host ? host : cache;
                d.src[d.n] = to_host ? cache : host;
                d.size[d.n++] = (size_t)p[3];
            }
        }
        out = issue(&fns, (void *)(uintptr_t)stream, &d);
        descriptors_free(&d);
    }
    PyBuffer_Release(&pieces.view);
    ints_free(&ids), ints_free(&rows);
    return out;
}

/* -- enqueue_runs --------------------------------------------------------------------------- */

PyDoc_STRVAR(enqueue_runs_doc,
"enqueue_runs(copy_fns, stream, to_host, host_base, staging_base, slot_bytes, rows, /)\n"
"    -> (error, failed_index)\n\n"
"GPU caches: enqueue on ``stream`` the copies between staging rows 0..n-1 and host rows\n"
"``rows``, one DMA per run of consecutive host rows.");

static PyObject *enqueue_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_nargs(nargs, 7, "enqueue_runs") < 0) {
        return NULL;
    }
    CopyFns fns;
    uint64_t stream, host_base, staging_base, slot_bytes;
    int to_host;
    if (copy_fns_from(args[0], &fns) < 0 || as_u64(args[1], &stream, "stream") < 0 || (to_host = PyObject_IsTrue(args[2])) < 0
        || as_u64(args[3], &host_base, "host_base") < 0 || as_u64(args[4], &staging_base, "staging_base") < 0
        || as_u64(args[5], &slot_bytes, "slot_bytes") < 0) {
        return NULL;
    }
    Ints rows;
    if (ints_from(args[6], &rows, "a host row") < 0) {
        return NULL;
    }
    PyObject *out = NULL;
    Descriptors d;
    if (descriptors_init(&d, (size_t)rows.n) == 0) {
        Py_ssize_t start = 0;
        for (Py_ssize_t i = 1; i <= rows.n; i++) {
            if (i == rows.n || rows.v[i] != rows.v[i - 1] + 1) {
                uint64_t host = host_base + rows.v[start] * slot_bytes, staging = staging_base + (uint64_t)start * slot_bytes;
                d.dst[d.n] = to_host ? host : staging;
                d.src[d.n] = to_host ? staging : host;
                d.size[d.n++] = (size_t)((uint64_t)(i - start) * slot_bytes);
                start = i;
            }
        }
        out = issue(&fns, (void *)(uintptr_t)stream, &d);
        descriptors_free(&d);
    }
    ints_free(&rows);
    return out;
}

/* -- launch_pieces -------------------------------------------------------------------------- */

PyDoc_STRVAR(launch_pieces_doc,
"launch_pieces(launch_fn, function, stream, params, blocks, max_blocks, tensors, threads, max_ctas, block_ids, /)\n"
"    -> error\n\n"
"GPU caches: launch the copy kernel ``function`` for ``block_ids``, up to ``max_blocks`` ids per\n"
"launch. ``blocks`` is the address of its ``struct { int n; int first; int ids[max_blocks]; }``\n"
"parameter, which ``params`` (the kernel's parameter array) points to; each launch has one CTA\n"
"per piece (``tensors`` per block), at most ``max_ctas`` when positive. Returns the first\n"
"error code (0: none).");

static PyObject *launch_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_nargs(nargs, 10, "launch_pieces") < 0) {
        return NULL;
    }
    uint64_t launch, function, stream, params, blocks, max_blocks, tensors, threads, max_ctas;
    if (as_u64(args[0], &launch, "launch_fn") < 0 || as_u64(args[1], &function, "function") < 0
        || as_u64(args[2], &stream, "stream") < 0 || as_u64(args[3], &params, "params") < 0
        || as_u64(args[4], &blocks, "blocks") < 0 || as_u64(args[5], &max_blocks, "max_blocks") < 0
        || as_u64(args[6], &tensors, "tensors") < 0 || as_u64(args[7], &threads, "threads") < 0
        || as_u64(args[8], &max_ctas, "max_ctas") < 0) {
        return NULL;
    }
    if (launch == 0 || blocks == 0 || max_blocks == 0 || max_blocks > INT32_MAX || tensors == 0 || tensors > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "launch_pieces: no launch function, parameters or pieces");
        return NULL;
    }
    Ints ids;
    if (ints_from(args[9], &ids, "a block id") < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < ids.n; i++) {
        if (ids.v[i] > INT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "block id %llu does not fit the kernel's int", (unsigned long long)ids.v[i]);
            ints_free(&ids);
            return NULL;
        }
    }
    int32_t *b = (int32_t *)(uintptr_t)blocks; /* n, first, ids[max_blocks] */
    int err = 0;
    for (Py_ssize_t first = 0; first < ids.n && err == 0; first += (Py_ssize_t)max_blocks) {
        Py_ssize_t n = ids.n - first < (Py_ssize_t)max_blocks ? ids.n - first : (Py_ssize_t)max_blocks;
        b[0] = (int32_t)n;
        b[1] = (int32_t)first;
        for (Py_ssize_t j = 0; j < n; j++) {
            b[2 + j] = (int32_t)ids.v[first + j];
        }
        uint64_t grid = (uint64_t)n * tensors;
        if (max_ctas > 0 && max_ctas < grid) {
            grid = max_ctas;
        }
        err = ((launch_kernel_fn)(uintptr_t)launch)((void *)(uintptr_t)function, (unsigned)grid, 1, 1, (unsigned)threads, 1, 1, 0,
                                                    (void *)(uintptr_t)stream, (void **)(uintptr_t)params, NULL);
    }
    ints_free(&ids);
    return PyLong_FromLong(err);
}

/* -- module --------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"memcpy_pieces", (PyCFunction)(void (*)(void))memcpy_pieces, METH_FASTCALL, memcpy_pieces_doc},
    {"enqueue_pieces", (PyCFunction)(void (*)(void))enqueue_pieces, METH_FASTCALL, enqueue_pieces_doc},
    {"enqueue_runs", (PyCFunction)(void (*)(void))enqueue_runs, METH_FASTCALL, enqueue_runs_doc},
    {"launch_pieces", (PyCFunction)(void (*)(void))launch_pieces, METH_FASTCALL, launch_pieces_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload._core.base.piece_copies",
    .m_doc = "Copies of KV-cache pieces between cache tensors and host rows, walked in C.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit_piece_copies(void)
{
    return PyModule_Create(&module);
}
