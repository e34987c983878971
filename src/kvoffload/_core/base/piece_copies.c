/* Copies of KV-cache pieces between cache tensors and host rows, walked in C.
 *
 * A piece is one block's bytes of one cache tensor (or of one slice of it): at
 * `base + block * stride` in the cache, at `row * slot_bytes + offset` in host memory. A
 * transfer of a few blocks of a 32-layer cache has dozens of pieces; walking them in Python
 * cost about a microsecond each (address arithmetic, a ctypes call per piece or a list per
 * descriptor), and a chunk's ten or so driver calls about as much each through ctypes. Here one
 * call walks them all:
 *
 *   memcpy_pieces   CPU caches: one memcpy per (block, piece); the GIL released for large copies.
 *   ChunkCopies     GPU caches: one chunk's driver calls in one call: the stream waits, the copy
 *                   kernel's launch (its block ids written into its parameters), the DMA
 *                   descriptors (one per run of host rows, or per (block, piece) when direct)
 *                   given to the batched copy at once, and the events.
 *   enqueue_pieces  GPU caches: one DMA per (block, piece) of one span of tensors (per-tensor
 *                   loads without the copy kernel).
 *   enqueue_runs    GPU caches: one DMA per run of host rows, to or from a staging buffer (chunks
 *                   gathered or scattered by torch, without the copy kernel).
 *   enqueue_ring    GPU caches: a stream wait and a host function that rings a semaphore once an
 *                   event completes (how the landing watcher and waiting threads are woken).
 *   context_status  whether the calling thread has a current CUDA context (asked per transfer).
 *   Event           GPU caches: a CUDA event made (from a pool of handles), recorded, queried and
 *                   given back in C: every transfer makes, queries and drops one or two.
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
#include <structmember.h>
#include <stddef.h>
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

/* Block ids and their host rows, as two Ints of one length; on failure neither is held. */
static int ids_and_rows_from(PyObject *ids_seq, PyObject *rows_seq, Ints *ids, Ints *rows)
{
    if (ints_from(ids_seq, ids, "a block id") < 0) {
        return -1;
    }
    if (ints_from(rows_seq, rows, "a host row") < 0) {
        ints_free(ids);
        return -1;
    }
    if (ids->n != rows->n) {
        PyErr_Format(PyExc_ValueError, "%zd block ids but %zd host rows", ids->n, rows->n);
        ints_free(ids), ints_free(rows);
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
    if (ids_and_rows_from(args[3], args[4], &ids, &rows) < 0) {
        return NULL;
    }
    Pieces pieces;
    if (pieces_from(args[5], &pieces) < 0) {
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

/* -- ChunkCopies --------------------------------------------------------------------------- */

typedef int (*event_record_fn)(void *event, void *stream);
typedef int (*stream_wait_fn)(void *stream, void *event, unsigned flags);

typedef struct EventCalls EventCalls;

/* A CUDA event (the Event type, below) */
typedef struct {
    PyObject_HEAD
    uint64_t handle;
    int device;
    EventCalls *calls;
} Event;

static PyTypeObject EventType;

/* The calls a chunk needs, by name, for errors: what failed is (error code, call, copy index). */
enum { CALL_WAIT, CALL_RECORD, CALL_COPY, CALL_LAUNCH, CALL_HOST_FUNC };
static const char *const call_names[] = {"cuStreamWaitEvent", "cuEventRecord", "copy", "cuLaunchKernel(move_pieces)", "cuLaunchHostFunc"};

typedef struct {
    PyObject_HEAD
    CopyFns copies;
    event_record_fn record;
    stream_wait_fn wait;
    void *kernel_stream, *copy_stream;
    void *between; /* an event recorded and waited for at once, under the caller's lock */
    uint64_t slot_bytes;
    uint64_t staging[2];
    void *staging_stream[2]; /* the stream each staging buffer's last chunk ended on (NULL: none known) */
    PyObject *pieces_owner;
    Pieces pieces;
    /* the copy kernel (launch == 0: none) and its parameters, written in place */
    launch_kernel_fn launch;
    void *function, **params;
    int32_t *blocks; /* n, first, ids[max_blocks] */
    uint64_t max_blocks, tensors, threads, max_ctas;
    uint64_t *staging_param, *cancel_param;
    int32_t *gather_param, *generation_param;
    /* chunk(): the events its chunks end with, and when a chunk is copied direct */
    PyObject *event_type, *device; /* done events are event_type(device), an Event type */
    uint64_t direct_max_copies, chunk_blocks;
    int turn;                  /* the staging buffer the next staged chunk takes */
    PyObject *staging_free[2]; /* each buffer's last chunk's done event (NULL: none) */
} ChunkCopies;

static int chunk_copies_init(ChunkCopies *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"copy_fns", "record", "wait", "kernel_stream", "copy_stream", "between", "slot_bytes",
                            "pieces", "staging", "kernel", "event_type", "device", "direct_max_copies", "chunk_blocks", NULL};
    PyObject *fns, *pieces, *staging, *kernel, *event_type = Py_None;
    int device = 0;
    unsigned long long record, wait, kernel_stream, copy_stream, between, slot_bytes, direct_max_copies = 0, chunk_blocks = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OKKKKKKOOO|$OiKK:ChunkCopies", names, &fns, &record, &wait, &kernel_stream,
                                     &copy_stream, &between, &slot_bytes, &pieces, &staging, &kernel, &event_type, &device,
                                     &direct_max_copies, &chunk_blocks)) {
        return -1;
    }
    if (event_type != Py_None && (!PyType_Check(event_type) || !PyType_IsSubtype((PyTypeObject *)event_type, &EventType))) {
        PyErr_SetString(PyExc_TypeError, "ChunkCopies: event_type must be an Event type");
        return -1;
    }
    if (self->pieces_owner != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ChunkCopies is initialised once");
        return -1;
    }
    if (copy_fns_from(fns, &self->copies) < 0) {
        return -1;
    }
    if (record == 0 || wait == 0 || kernel_stream == 0 || copy_stream == 0 || between == 0 || slot_bytes == 0) {
        PyErr_SetString(PyExc_ValueError, "ChunkCopies: a function, stream, event or slot size is 0");
        return -1;
    }
    self->record = (event_record_fn)(uintptr_t)record;
    self->wait = (stream_wait_fn)(uintptr_t)wait;
    self->kernel_stream = (void *)(uintptr_t)kernel_stream;
    self->copy_stream = (void *)(uintptr_t)copy_stream;
    self->between = (void *)(uintptr_t)between;
    self->slot_bytes = slot_bytes;
    if (!PyTuple_Check(staging) || PyTuple_GET_SIZE(staging) != 2 || as_u64(PyTuple_GET_ITEM(staging, 0), &self->staging[0], "staging") < 0
        || as_u64(PyTuple_GET_ITEM(staging, 1), &self->staging[1], "staging") < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "staging: a tuple of two addresses (0: no staging)");
        }
        return -1;
    }
    if (kernel != Py_None) {
        uint64_t k[12];
        if (!PyTuple_Check(kernel) || PyTuple_GET_SIZE(kernel) != 12) {
            PyErr_SetString(PyExc_TypeError, "kernel: None or a tuple (launch, function, params, blocks, max_blocks, tensors, "
                                             "threads, max_ctas, staging, gather, cancel, generation)");
            return -1;
        }
        for (int i = 0; i < 12; i++) {
            if (as_u64(PyTuple_GET_ITEM(kernel, i), &k[i], "a kernel parameter") < 0) {
                return -1;
            }
        }
        if (k[0] == 0 || k[2] == 0 || k[3] == 0 || k[4] == 0 || k[4] > INT32_MAX || k[5] == 0 || k[6] == 0 || k[8] == 0
            || k[9] == 0 || k[10] == 0 || k[11] == 0) {
            PyErr_SetString(PyExc_ValueError, "kernel: a function, parameter address or count is 0");
            return -1;
        }
        self->launch = (launch_kernel_fn)(uintptr_t)k[0];
        self->function = (void *)(uintptr_t)k[1];
        self->params = (void **)(uintptr_t)k[2];
        self->blocks = (int32_t *)(uintptr_t)k[3];
        self->max_blocks = k[4], self->tensors = k[5], self->threads = k[6], self->max_ctas = k[7];
        self->staging_param = (uint64_t *)(uintptr_t)k[8];
        self->gather_param = (int32_t *)(uintptr_t)k[9];
        self->cancel_param = (uint64_t *)(uintptr_t)k[10];
        self->generation_param = (int32_t *)(uintptr_t)k[11];
    }
    if (pieces_from(pieces, &self->pieces) < 0) {
        return -1;
    }
    if (event_type != Py_None) {
        if ((self->device = PyLong_FromLong(device)) == NULL) {
            PyBuffer_Release(&self->pieces.view);
            return -1;
        }
        Py_INCREF(event_type);
        self->event_type = event_type;
    }
    self->direct_max_copies = direct_max_copies, self->chunk_blocks = chunk_blocks;
    Py_INCREF(pieces);
    self->pieces_owner = pieces;
    return 0;
}

static void chunk_copies_dealloc(ChunkCopies *self)
{
    Py_CLEAR(self->event_type);
    Py_CLEAR(self->device);
    Py_CLEAR(self->staging_free[0]);
    Py_CLEAR(self->staging_free[1]);
    if (self->pieces_owner != NULL) {
        PyBuffer_Release(&self->pieces.view);
        Py_CLEAR(self->pieces_owner);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* What failed: None (nothing), else (error code, call name, copy index). */
typedef struct {
    int err, call;
    size_t index;
} Outcome;

static PyObject *outcome_object(const Outcome *o)
{
    if (o->err == 0) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(isn)", o->err, call_names[o->call], (Py_ssize_t)o->index);
}

static int failed(Outcome *o, int err, int call)
{
    o->err = err, o->call = call, o->index = 0;
    return err != 0;
}

static int issue_into(const CopyFns *fns, void *stream, Descriptors *d, Outcome *o)
{
    size_t index = 0;
    int err = 0;
    if (d->n > 0 && fns->batch != NULL) {
        size_t attrs_idx = 0;
        err = fns->batch(d->dst, d->src, d->size, d->n, fns->attrs, &attrs_idx, 1, &index, stream);
    } else {
        for (size_t i = 0; i < d->n && err == 0; i++) {
            err = fns->one(d->dst[i], d->src[i], d->size[i], stream);
            index = i;
        }
    }
    o->err = err, o->call = CALL_COPY, o->index = err != 0 ? index : 0;
    return err != 0;
}

/* One descriptor per run of consecutive host rows, between them and staging rows 0..n-1. */
static int runs_into(Descriptors *d, const Ints *rows, int to_host, uint64_t host_base, uint64_t staging_base, uint64_t slot)
{
    if (descriptors_init(d, (size_t)rows->n) < 0) {
        return -1;
    }
    Py_ssize_t start = 0;
    for (Py_ssize_t i = 1; i <= rows->n; i++) {
        if (i == rows->n || rows->v[i] != rows->v[i - 1] + 1) {
            uint64_t host = host_base + rows->v[start] * slot, stage = staging_base + (uint64_t)start * slot;
            d->dst[d->n] = to_host ? host : stage;
            d->src[d->n] = to_host ? stage : host;
            d->size[d->n++] = (size_t)((uint64_t)(i - start) * slot);
            start = i;
        }
    }
    return 0;
}

/* One descriptor per (block, piece) between cache blocks and host rows, for pieces [first, stop). */
static int pieces_into(Descriptors *d, const Pieces *pieces, Py_ssize_t first, Py_ssize_t stop, const Ints *ids, const Ints *rows,
                       int to_host, uint64_t host_base, uint64_t slot)
{
    if (descriptors_init(d, (size_t)ids->n * (size_t)(stop - first)) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < ids->n; i++) {
        uint64_t row = host_base + rows->v[i] * slot;
        for (Py_ssize_t j = first; j < stop; j++) {
            const uint64_t *p = pieces->p + 4 * j;
            uint64_t cache = p[0] + ids->v[i] * p[1], host = row + p[2];
            d->dst[d->n] = to_host ? host : cache;
            d->src[d->n] = to_host ? cache : host;
            d->size[d->n++] = (size_t)p[3];
        }
    }
    return 0;
}

static int launch_into(ChunkCopies *self, void *stream, const Ints *ids, Outcome *o)
{
    for (Py_ssize_t first = 0; first < ids->n; first += (Py_ssize_t)self->max_blocks) {
        Py_ssize_t n = ids->n - first < (Py_ssize_t)self->max_blocks ? ids->n - first : (Py_ssize_t)self->max_blocks;
        self->blocks[0] = (int32_t)n;
        self->blocks[1] = (int32_t)first;
        for (Py_ssize_t j = 0; j < n; j++) {
            self->blocks[2 + j] = (int32_t)ids->v[first + j];
        }
        uint64_t grid = (uint64_t)n * self->tensors;
        if (self->max_ctas > 0 && self->max_ctas < grid) {
            grid = self->max_ctas;
        }
        int err = self->launch(self->function, (unsigned)grid, 1, 1, (unsigned)self->threads, 1, 1, 0, stream, self->params, NULL);
        if (failed(o, err, CALL_LAUNCH)) {
            return 1;
        }
    }
    return 0;
}

/* What runs on `stream` from here waits for the work enqueued so far on `caller` (nothing unless
   `has_caller`: 0 is a stream, the legacy default one); 1 if a call failed.
   `between` serves: a wait uses the event's state when it is enqueued, and calls come one at a time. */
static int caller_into(ChunkCopies *self, int has_caller, uint64_t caller, void *stream, Outcome *o)
{
    if (!has_caller) {
        return 0;
    }
    return failed(o, self->record(self->between, (void *)(uintptr_t)caller), CALL_RECORD)
        || failed(o, self->wait(stream, self->between, 0), CALL_WAIT);
}

/* What runs on `second` from here waits for what was enqueued on `first` (nothing if they are one); 1 if a call failed. */
static int cross_into(ChunkCopies *self, void *first, void *second, Outcome *o)
{
    if (first == second) {
        return 0;
    }
    return failed(o, self->record(self->between, first), CALL_RECORD) || failed(o, self->wait(second, self->between, 0), CALL_WAIT);
}

PyDoc_STRVAR(chunk_copies_copy_doc,
"copy(to_host, direct, host_base, rows, block_ids, staging, free_event, done_event, cancel_address, generation,\n"
"     one_stream, caller_stream, /) -> None | (error, call, copy_index)\n\n"
"Enqueue one chunk's copies between cache blocks ``block_ids`` and host rows ``rows``, and record\n"
"``done_event`` once they are complete: on the copy stream for a store, the kernel stream for a load.\n"
"``direct``: one DMA per (block, piece); else through staging buffer ``staging`` (0 or 1; its last\n"
"use ``free_event`` waited for first, 0: none), gathered or scattered by the copy kernel (reading\n"
"the cancel flag at ``cancel_address``, 0: none) and moved with one DMA per run of host rows.\n"
"``one_stream``: every copy of the chunk on the stream its end is recorded on (no event between\n"
"the two streams: a chunk no later chunk of its transfer overlaps); the staging buffer's last use is\n"
"then not waited for if it ended on that stream. ``caller_stream`` (a raw CUstream, 0 the legacy\n"
"default stream; None: none): the\n"
"chunk's first stream first waits for the work enqueued there so far (its other stream follows the\n"
"first, and so do later chunks of the transfer).\n"
"Returns None, or what failed: the driver's error code, the call and the index of the copy.\n"
"The copier calls :meth:`chunk`, which makes these choices and calls the same code; this form\n"
"takes them as arguments, so that each path's driver calls can be checked on their own.");

static PyObject *copy_chunk(ChunkCopies *self, int to_host, int direct, uint64_t host_base, PyObject *rows_arg, PyObject *ids_arg,
                            uint64_t staging, uint64_t free_event, uint64_t done_event, uint64_t cancel_address, uint64_t generation,
                            int one_stream, int has_caller, uint64_t caller);

static PyObject *chunk_copies_copy(ChunkCopies *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 12, "copy") < 0) {
        return NULL;
    }
    if (self->pieces_owner == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ChunkCopies not initialised");
        return NULL;
    }
    int to_host, direct, one_stream;
    uint64_t host_base, staging, free_event, done_event, cancel_address, generation, caller = 0;
    int has_caller = args[11] != Py_None;
    if ((to_host = PyObject_IsTrue(args[0])) < 0 || (direct = PyObject_IsTrue(args[1])) < 0
        || as_u64(args[2], &host_base, "host_base") < 0 || as_u64(args[5], &staging, "staging") < 0
        || as_u64(args[6], &free_event, "free_event") < 0 || as_u64(args[7], &done_event, "done_event") < 0
        || as_u64(args[8], &cancel_address, "cancel_address") < 0 || as_u64(args[9], &generation, "generation") < 0
        || (one_stream = PyObject_IsTrue(args[10])) < 0 || (has_caller && as_u64(args[11], &caller, "caller_stream") < 0)) {
        return NULL;
    }
    return copy_chunk(self, to_host, direct, host_base, args[3], args[4], staging, free_event, done_event, cancel_address, generation,
                      one_stream, has_caller, caller);
}

/* copy()'s work, its arguments converted: None, what failed, or NULL with an exception set. */
static PyObject *copy_chunk(ChunkCopies *self, int to_host, int direct, uint64_t host_base, PyObject *rows_arg, PyObject *ids_arg,
                            uint64_t staging, uint64_t free_event, uint64_t done_event, uint64_t cancel_address, uint64_t generation,
                            int one_stream, int has_caller, uint64_t caller)
{
    if (done_event == 0) {
        PyErr_SetString(PyExc_ValueError, "copy: no done event");
        return NULL;
    }
    if (!direct && (self->launch == NULL || staging > 1 || self->staging[staging] == 0)) {
        PyErr_SetString(PyExc_ValueError, "copy: no staging buffer or copy kernel for a staged chunk");
        return NULL;
    }
    Ints ids, rows;
    if (ids_and_rows_from(ids_arg, rows_arg, &ids, &rows) < 0) {
        return NULL;
    }
    PyObject *out = NULL;
    for (Py_ssize_t i = 0; !direct && i < ids.n; i++) {
        if (ids.v[i] > INT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "block id %llu does not fit the kernel's int", (unsigned long long)ids.v[i]);
            goto done;
        }
    }
    Descriptors d;
    int built = direct ? pieces_into(&d, &self->pieces, 0, self->pieces.n, &ids, &rows, to_host, host_base, self->slot_bytes)
                       : runs_into(&d, &rows, to_host, host_base, self->staging[staging], self->slot_bytes);
    if (built < 0) {
        goto done;
    }
    Outcome o = {0, 0, 0};
    void *k = self->kernel_stream, *c = self->copy_stream, *between = self->between, *done = (void *)(uintptr_t)done_event;
    if (direct) {
        /* cache <-> host slots on the copy stream (one stream: a load's on the kernel stream); a load's
           end is recorded on the kernel stream */
        void *dma = one_stream && !to_host ? k : c;
        if (!caller_into(self, has_caller, caller, dma, &o) && !issue_into(&self->copies, dma, &d, &o)) {
            if (to_host || dma == k) {
                failed(&o, self->record(done, dma), CALL_RECORD);
            } else if (!failed(&o, self->record(between, c), CALL_RECORD) && !failed(&o, self->wait(k, between, 0), CALL_WAIT)) {
                failed(&o, self->record(done, k), CALL_RECORD);
            }
        }
    } else {
        *self->staging_param = self->staging[staging];
        *self->gather_param = to_host;
        *self->cancel_param = cancel_address;
        *self->generation_param = (int32_t)generation;
        /* a store gathers on the kernel stream, then moves to host on the copy stream; a load the other
           way round; one stream: both on the one its end is recorded on */
        void *second = to_host ? c : k, *first = one_stream ? second : to_host ? k : c;
        /* the buffer's last use, unless it ended on the stream this chunk starts on (then stream order suffices) */
        int wait_free = free_event != 0 && !(one_stream && self->staging_stream[staging] == first);
        self->staging_stream[staging] = NULL; /* unknown until this chunk is enqueued whole */
        if (caller_into(self, has_caller, caller, first, &o) || (wait_free && failed(&o, self->wait(first, (void *)(uintptr_t)free_event, 0), CALL_WAIT))) {
            /* stop */
        } else if (to_host) {
            if (!launch_into(self, first, &ids, &o) && !cross_into(self, first, second, &o) && !issue_into(&self->copies, second, &d, &o)) {
                failed(&o, self->record(done, second), CALL_RECORD);
            }
        } else {
            if (!issue_into(&self->copies, first, &d, &o) && !cross_into(self, first, second, &o) && !launch_into(self, second, &ids, &o)) {
                failed(&o, self->record(done, second), CALL_RECORD);
            }
        }
        if (o.err == 0) {
            self->staging_stream[staging] = second;
        }
    }
    descriptors_free(&d);
    out = outcome_object(&o);
done:
    ints_free(&ids), ints_free(&rows);
    return out;
}

PyDoc_STRVAR(chunk_copies_chunk_doc,
"chunk(to_host, host_base, rows, block_ids, caller_stream, cancel_address, generation, /)\n"
"    -> Event | (error, call, copy_index)\n\n"
"One chunk of a transfer, as :meth:`copy` enqueues it, the choices made here: copied direct when\n"
"there is no staging or copy kernel, or when it has at most ``direct_max_copies`` (block, piece)\n"
"pairs and no cancel flag (``cancel_address`` 0); else staged through the buffers in turn, each\n"
"buffer's last chunk waited for, on one stream when shorter than ``chunk_blocks`` (a transfer's\n"
"last or only chunk). Returns the event it ends with (``event_type(device)``), or what failed (the\n"
"chunk is then not the buffer's last use).");

static PyObject *chunk_copies_chunk(ChunkCopies *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 7, "chunk") < 0) {
        return NULL;
    }
    if (self->pieces_owner == NULL || self->event_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ChunkCopies.chunk: not initialised with an event_type");
        return NULL;
    }
    int to_host;
    uint64_t host_base, cancel_address, generation, caller = 0;
    int has_caller = args[4] != Py_None;
    if ((to_host = PyObject_IsTrue(args[0])) < 0 || as_u64(args[1], &host_base, "host_base") < 0
        || (has_caller && as_u64(args[4], &caller, "caller_stream") < 0) || as_u64(args[5], &cancel_address, "cancel_address") < 0
        || as_u64(args[6], &generation, "generation") < 0) {
        return NULL;
    }
    Py_ssize_t n = PyObject_Length(args[3]);
    if (n < 0) {
        return NULL;
    }
    int staged = self->staging[0] != 0 && self->launch != NULL;
    int direct = !staged || ((uint64_t)n * (uint64_t)self->pieces.n <= self->direct_max_copies && cancel_address == 0);
    PyObject *done = PyObject_CallOneArg(self->event_type, self->device);
    if (done == NULL) {
        return NULL;
    }
    int b = 0;
    uint64_t free_event = 0;
    if (!direct) {
        b = self->turn;
        self->turn ^= 1;
        if (self->staging_free[b] != NULL) {
            free_event = ((Event *)self->staging_free[b])->handle;
        }
    }
    PyObject *out = copy_chunk(self, to_host, direct, host_base, args[2], args[3], (uint64_t)b, free_event, ((Event *)done)->handle,
                               direct ? 0 : cancel_address, direct ? 0 : generation, direct || (uint64_t)n < self->chunk_blocks,
                               has_caller, caller);
    if (out != Py_None) { /* what failed, or an exception */
        Py_DECREF(done);
        return out;
    }
    Py_DECREF(out);
    if (!direct) {
        Py_INCREF(done);
        Py_XSETREF(self->staging_free[b], done);
    }
    return done;
}

/* The one argument of wait() / wait_for_stream(), a handle; 0 with an exception set if bad or uninitialised. */
static int handle_for(ChunkCopies *self, PyObject *arg, uint64_t *out, const char *what)
{
    if (as_u64(arg, out, what) < 0) {
        return 0;
    }
    if (self->pieces_owner == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ChunkCopies not initialised");
        return 0;
    }
    return 1;
}

/* Both streams wait for `event`; 1 if a wait failed (reported in `o`). */
static int both_wait(ChunkCopies *self, void *event, Outcome *o)
{
    return failed(o, self->wait(self->kernel_stream, event, 0), CALL_WAIT)
        || failed(o, self->wait(self->copy_stream, event, 0), CALL_WAIT);
}

PyDoc_STRVAR(chunk_copies_wait_doc,
"wait(event, /) -> None | (error, call, 0)\n\n"
"Make both streams wait for ``event`` (a raw CUevent): every later chunk runs after it.");

static PyObject *chunk_copies_wait(ChunkCopies *self, PyObject *event_arg)
{
    uint64_t event;
    if (!handle_for(self, event_arg, &event, "event")) {
        return NULL;
    }
    Outcome o = {0, 0, 0};
    both_wait(self, (void *)(uintptr_t)event, &o);
    return outcome_object(&o);
}

PyDoc_STRVAR(chunk_copies_wait_for_stream_doc,
"wait_for_stream(stream, /) -> None | (error, call, 0)\n\n"
"Make both streams wait for the work enqueued so far on ``stream`` (a raw CUstream, the caller's):\n"
"its own event recorded there, then waited for; every later chunk runs after that work.");

static PyObject *chunk_copies_wait_for_stream(ChunkCopies *self, PyObject *stream_arg)
{
    uint64_t stream;
    if (!handle_for(self, stream_arg, &stream, "stream")) {
        return NULL;
    }
    /* `between` serves here too: a wait uses the event's state when it is enqueued, and calls come one at a time */
    Outcome o = {0, 0, 0};
    if (!failed(&o, self->record(self->between, (void *)(uintptr_t)stream), CALL_RECORD)) {
        both_wait(self, self->between, &o);
    }
    return outcome_object(&o);
}

static PyMethodDef chunk_copies_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))chunk_copies_copy, METH_FASTCALL, chunk_copies_copy_doc},
    {"chunk", (PyCFunction)(void (*)(void))chunk_copies_chunk, METH_FASTCALL, chunk_copies_chunk_doc},
    {"wait", (PyCFunction)chunk_copies_wait, METH_O, chunk_copies_wait_doc},
    {"wait_for_stream", (PyCFunction)chunk_copies_wait_for_stream, METH_O, chunk_copies_wait_for_stream_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(chunk_copies_doc,
"ChunkCopies(copy_fns, record, wait, kernel_stream, copy_stream, between, slot_bytes, pieces, staging, kernel)\n\n"
"One GPU copier's chunks, each enqueued by one call: the stream waits, the copy kernel's launch,\n"
"the DMA descriptors and the events, in C. ``record`` / ``wait``: the addresses of cuEventRecord\n"
"and cuStreamWaitEvent; ``between``: an event of its own, recorded and waited for within a call;\n"
"``staging``: the two staging buffers' addresses (0: none); ``kernel``: None, or (cuLaunchKernel,\n"
"the function, its parameter array, its Blocks parameter, MAX_BLOCKS, tensors, threads per CTA,\n"
"max CTAs, then the addresses of its staging, gather, cancel and generation parameters).\n"
"For :meth:`chunk`: ``event_type`` (an :class:`Event` type) and ``device``, what its chunks' end\n"
"events are made as; ``direct_max_copies`` and ``chunk_blocks``, its choices.\n"
"Calls are made one at a time (the caller's lock): the kernel's parameters are written in place.");

static PyTypeObject ChunkCopiesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload._core.base.piece_copies.ChunkCopies",
    .tp_basicsize = sizeof(ChunkCopies),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = chunk_copies_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)chunk_copies_init,
    .tp_dealloc = (destructor)chunk_copies_dealloc,
    .tp_methods = chunk_copies_methods,
};

/* -- enqueue_pieces ------------------------------------------------------------------------- */

PyDoc_STRVAR(enqueue_pieces_doc,
"enqueue_pieces(copy_fns, stream, to_host, host_base, slot_bytes, block_ids, rows, pieces, first, stop, /)\n"
"    -> None | (error, call, copy_index)\n\n"
"GPU caches: enqueue on ``stream`` one DMA per (block, piece) for pieces ``[first, stop)`` (one\n"
"span of tensors), block by block, between cache blocks ``block_ids`` and host rows ``rows``.\n"
"Returns None, or what failed: the driver's error code, the call and the index of the copy.");

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
    if (ids_and_rows_from(args[5], args[6], &ids, &rows) < 0) {
        return NULL;
    }
    Pieces pieces;
    if (pieces_from(args[7], &pieces) < 0) {
        ints_free(&ids), ints_free(&rows);
        return NULL;
    }
    PyObject *out = NULL;
    Descriptors d;
    if (first > stop || stop > (uint64_t)pieces.n) {
        PyErr_Format(PyExc_ValueError, "pieces [%llu, %llu) of %zd", (unsigned long long)first, (unsigned long long)stop, pieces.n);
    } else if (pieces_into(&d, &pieces, (Py_ssize_t)first, (Py_ssize_t)stop, &ids, &rows, to_host, host_base, slot_bytes) == 0) {
        Outcome o = {0, 0, 0};
        issue_into(&fns, (void *)(uintptr_t)stream, &d, &o);
        descriptors_free(&d);
        out = outcome_object(&o);
    }
    PyBuffer_Release(&pieces.view);
    ints_free(&ids), ints_free(&rows);
    return out;
}

/* -- enqueue_runs --------------------------------------------------------------------------- */

PyDoc_STRVAR(enqueue_runs_doc,
"enqueue_runs(copy_fns, stream, to_host, host_base, staging_base, slot_bytes, rows, /)\n"
"    -> None | (error, call, copy_index)\n\n"
"GPU caches: enqueue on ``stream`` the copies between staging rows 0..n-1 and host rows ``rows``,\n"
"one DMA per run of consecutive host rows (staged chunks gathered or scattered by torch, where\n"
"the copy kernel is missing). Returns as :func:`enqueue_pieces` does.");

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
    if (runs_into(&d, &rows, to_host, host_base, staging_base, slot_bytes) == 0) {
        Outcome o = {0, 0, 0};
        issue_into(&fns, (void *)(uintptr_t)stream, &d, &o);
        descriptors_free(&d);
        out = outcome_object(&o);
    }
    ints_free(&rows);
    return out;
}

/* -- enqueue_ring, context_status ----------------------------------------------------------- */

typedef int (*launch_host_func_fn)(void *stream, void *fn, void *data);
typedef int (*ctx_get_current_fn)(void **ctx);

PyDoc_STRVAR(enqueue_ring_doc,
"enqueue_ring(wait, launch_host_func, stream, event, fn, data, /) -> None | (error, call, 0)\n\n"
"Make ``stream`` wait for ``event``, then call the C function ``fn(data)`` from the driver's thread\n"
"(cuStreamWaitEvent, cuLaunchHostFunc: their addresses given first): a ring once ``event`` completes.");

static PyObject *enqueue_ring(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t v[6];
    static const char *const what[] = {"wait", "launch_host_func", "stream", "event", "fn", "data"};
    if (check_nargs(nargs, 6, "enqueue_ring") < 0) {
        return NULL;
    }
    for (int i = 0; i < 6; i++) {
        if (as_u64(args[i], &v[i], what[i]) < 0) {
            return NULL;
        }
    }
    if (v[0] == 0 || v[1] == 0 || v[4] == 0) {
        PyErr_SetString(PyExc_ValueError, "enqueue_ring: a function address is 0");
        return NULL;
    }
    stream_wait_fn wait = (stream_wait_fn)(uintptr_t)v[0];
    launch_host_func_fn launch = (launch_host_func_fn)(uintptr_t)v[1];
    void *stream = (void *)(uintptr_t)v[2];
    Outcome o = {0, 0, 0};
    if (!failed(&o, wait(stream, (void *)(uintptr_t)v[3], 0), CALL_WAIT)) {
        failed(&o, launch(stream, (void *)(uintptr_t)v[4], (void *)(uintptr_t)v[5]), CALL_HOST_FUNC);
    }
    return outcome_object(&o);
}

PyDoc_STRVAR(context_status_doc,
"context_status(ctx_get_current, /) -> int\n\n"
"Whether the calling thread has a current CUDA context (``cuCtxGetCurrent``, its address given):\n"
"0 if it has, -1 if it has none, else the driver's error code.");

static PyObject *context_status(PyObject *self, PyObject *fn_arg)
{
    uint64_t fn;
    if (as_u64(fn_arg, &fn, "ctx_get_current") < 0) {
        return NULL;
    }
    if (fn == 0) {
        PyErr_SetString(PyExc_ValueError, "context_status: the function address is 0");
        return NULL;
    }
    void *ctx = NULL;
    int err = ((ctx_get_current_fn)(uintptr_t)fn)(&ctx);
    return PyLong_FromLong(err ? err : ctx != NULL ? 0 : -1);
}

/* -- Event, EventCalls ---------------------------------------------------------------------- */

typedef int (*event_create_fn)(void **event, unsigned flags);
typedef int (*event_destroy_fn)(void *event);
typedef int (*event_query_fn)(void *event);

#define MAX_DEVICES 64
#define CUDA_ERROR_NOT_READY 600

struct EventCalls {
    PyObject_HEAD
    event_create_fn create;
    event_destroy_fn destroy;
    event_record_fn record;
    event_query_fn query;
    unsigned flags;
    Py_ssize_t max_pooled;
    PyObject *check; /* check(call, error): raises the error as the driver names it */
    PyObject *owner; /* kept alive: what the addresses point into (a stand-in driver's callbacks) */
    void **free[MAX_DEVICES]; /* per device: handles of events gone, for the next ones */
    Py_ssize_t nfree[MAX_DEVICES], capacity[MAX_DEVICES];
};

static int event_calls_init(EventCalls *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"create", "destroy", "record", "query", "flags", "max_pooled", "check", "owner", NULL};
    unsigned long long create, destroy, record, query;
    unsigned int flags;
    Py_ssize_t max_pooled;
    PyObject *check, *owner;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KKKKInOO:EventCalls", names, &create, &destroy, &record, &query, &flags,
                                     &max_pooled, &check, &owner)) {
        return -1;
    }
    if (self->check != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "EventCalls is initialised once");
        return -1;
    }
    if (create == 0 || destroy == 0 || record == 0 || query == 0 || max_pooled < 0 || !PyCallable_Check(check)) {
        PyErr_SetString(PyExc_ValueError, "EventCalls: a function address is 0, max_pooled < 0 or check not callable");
        return -1;
    }
    self->create = (event_create_fn)(uintptr_t)create;
    self->destroy = (event_destroy_fn)(uintptr_t)destroy;
    self->record = (event_record_fn)(uintptr_t)record;
    self->query = (event_query_fn)(uintptr_t)query;
    self->flags = flags;
    self->max_pooled = max_pooled;
    Py_INCREF(check);
    self->check = check;
    Py_INCREF(owner);
    self->owner = owner;
    return 0;
}

static void event_calls_dealloc(EventCalls *self)
{
    /* the handles pooled are not destroyed: the driver's table lives as long as the process, and a
       stand-in's handles are its own */
    for (int d = 0; d < MAX_DEVICES; d++) {
        PyMem_Free(self->free[d]);
    }
    Py_CLEAR(self->check);
    Py_CLEAR(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(event_calls_pooled_doc, "pooled(device, /) -> int\n\nHow many handles of gone events wait for reuse on ``device``.");

static PyObject *event_calls_pooled(EventCalls *self, PyObject *device_arg)
{
    long d = PyLong_AsLong(device_arg);
    if (d == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return PyLong_FromSsize_t(d >= 0 && d < MAX_DEVICES ? self->nfree[d] : 0);
}

static PyMethodDef event_calls_methods[] = {
    {"pooled", (PyCFunction)event_calls_pooled, METH_O, event_calls_pooled_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(event_calls_doc,
"EventCalls(create, destroy, record, query, flags, max_pooled, check, owner)\n\n"
"The driver's event functions (addresses of cuEventCreate, cuEventDestroy, cuEventRecord,\n"
"cuEventQuery), the flags events are made with, and per device a pool of at most ``max_pooled``\n"
"handles of events gone, for :class:`Event`. ``check(call, error)`` raises a failed call's error;\n"
"``owner`` is kept alive (what the addresses point into).");

static PyTypeObject EventCallsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload._core.base.piece_copies.EventCalls",
    .tp_basicsize = sizeof(EventCalls),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = event_calls_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)event_calls_init,
    .tp_dealloc = (destructor)event_calls_dealloc,
    .tp_methods = event_calls_methods,
};

static EventCalls *current_event_calls = NULL; /* what new events use (use_event_calls) */
static PyObject *event_calls_loader = NULL;    /* called when none is set yet: sets one */

/* Raise what `err` of `call` is, through the table's check(); NULL. */
static PyObject *event_error(EventCalls *calls, const char *call, int err)
{
    PyObject *r = PyObject_CallFunction(calls->check, "si", call, err);
    if (r != NULL) { /* check() returned: it should have raised */
        Py_DECREF(r);
        PyErr_Format(PyExc_RuntimeError, "%s failed with error %d", call, err);
    }
    return NULL;
}

static PyObject *event_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    int device;
    if ((kwds != NULL && PyDict_GET_SIZE(kwds) != 0) || !PyArg_ParseTuple(args, "i:Event", &device)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "Event(device_index): no keyword arguments");
        }
        return NULL;
    }
    if (device < 0) {
        PyErr_SetString(PyExc_ValueError, "Event: device index < 0");
        return NULL;
    }
    if (current_event_calls == NULL && event_calls_loader != NULL) {
        PyObject *r = PyObject_CallNoArgs(event_calls_loader);
        if (r == NULL) {
            return NULL;
        }
        Py_DECREF(r);
    }
    EventCalls *calls = current_event_calls;
    if (calls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Event: no driver functions (use_event_calls)");
        return NULL;
    }
    Event *self = (Event *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    Py_INCREF(calls);
    self->calls = calls;
    self->device = device;
    if (device < MAX_DEVICES && calls->nfree[device] > 0) {
        self->handle = (uint64_t)(uintptr_t)calls->free[device][--calls->nfree[device]];
        return (PyObject *)self;
    }
    void *out = NULL;
    int err = calls->create(&out, calls->flags);
    if (err) {
        Py_DECREF(self);
        return event_error(calls, "cuEventCreate", err);
    }
    self->handle = (uint64_t)(uintptr_t)out;
    return (PyObject *)self;
}

static void event_dealloc(Event *self)
{
    EventCalls *calls = self->calls;
    if (calls != NULL && self->handle != 0) {
        int d = self->device;
        void *handle = (void *)(uintptr_t)self->handle;
        self->handle = 0;
        int pooled = 0;
        if (d < MAX_DEVICES && calls->nfree[d] < calls->max_pooled) {
            if (calls->nfree[d] == calls->capacity[d]) {
                Py_ssize_t grown = calls->capacity[d] ? 2 * calls->capacity[d] : 64;
                void **more = PyMem_Realloc(calls->free[d], (size_t)grown * sizeof(void *));
                if (more != NULL) {
                    calls->free[d] = more;
                    calls->capacity[d] = grown;
                }
            }
            if (calls->nfree[d] < calls->capacity[d]) {
                calls->free[d][calls->nfree[d]++] = handle;
                pooled = 1;
            }
        }
        if (!pooled) {
            calls->destroy(handle); /* nothing to do about a failure here */
        }
    }
    Py_CLEAR(self->calls);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(event_record_doc, "record(stream, /) -> self\n\nRecord on ``stream`` (a raw CUstream).");

static PyObject *event_record(Event *self, PyObject *stream_arg)
{
    uint64_t stream;
    if (as_u64(stream_arg, &stream, "stream") < 0) {
        return NULL;
    }
    int err = self->calls->record((void *)(uintptr_t)self->handle, (void *)(uintptr_t)stream);
    if (err) {
        return event_error(self->calls, "cuEventRecord", err);
    }
    Py_INCREF(self);
    return (PyObject *)self;
}

PyDoc_STRVAR(event_query_doc,
"query() -> bool\n\n"
"True once the work recorded before the event has completed, False while it runs. Raises the\n"
"driver's error (``check``) if that work failed: an asynchronous fault, which leaves the\n"
"context unusable; the event is settled and what it covers did not land.");

static PyObject *event_query(Event *self, PyObject *Py_UNUSED(ignored))
{
    int err = self->calls->query((void *)(uintptr_t)self->handle);
    if (err == 0) {
        Py_RETURN_TRUE;
    }
    if (err == CUDA_ERROR_NOT_READY) {
        Py_RETURN_FALSE;
    }
    return event_error(self->calls, "cuEventQuery", err);
}

static PyMethodDef event_methods[] = {
    {"record", (PyCFunction)event_record, METH_O, event_record_doc},
    {"query", (PyCFunction)event_query, METH_NOARGS, event_query_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef event_members[] = {
    {"handle", T_ULONGLONG, offsetof(Event, handle), READONLY, "The raw CUevent."},
    {"device", T_INT, offsetof(Event, device), READONLY, "The device index it was made for."},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(event_doc,
"Event(device_index)\n\n"
"A CUDA event of the driver functions :func:`use_event_calls` set, made from their pool of handles\n"
"of events gone (else by cuEventCreate), recorded and queried in C, its handle back in the pool\n"
"when it is gone. Reuse is safe: a stream wait or a host function enqueued on an event uses the\n"
"state it captured then, which a later record does not change.");

static PyTypeObject EventType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload._core.base.piece_copies.Event",
    .tp_basicsize = sizeof(Event),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = event_doc,
    .tp_new = event_new,
    .tp_dealloc = (destructor)event_dealloc,
    .tp_methods = event_methods,
    .tp_members = event_members,
};

PyDoc_STRVAR(use_event_calls_doc,
"use_event_calls(calls, /) -> EventCalls | None\n\n"
"New :class:`Event` s use ``calls`` (an :class:`EventCalls`, or None: none); returns those used before.");

static PyObject *use_event_calls(PyObject *self, PyObject *calls)
{
    (void)self;
    if (calls != Py_None && !PyObject_TypeCheck(calls, &EventCallsType)) {
        PyErr_SetString(PyExc_TypeError, "use_event_calls: an EventCalls or None");
        return NULL;
    }
    PyObject *previous = current_event_calls != NULL ? (PyObject *)current_event_calls : Py_None;
    Py_INCREF(previous);
    Py_XDECREF(current_event_calls);
    if (calls == Py_None) {
        current_event_calls = NULL;
    } else {
        Py_INCREF(calls);
        current_event_calls = (EventCalls *)calls;
    }
    return previous; /* its reference moves to the caller */
}

PyDoc_STRVAR(set_event_calls_loader_doc,
"set_event_calls_loader(loader, /) -> None\n\n"
"``loader()`` is called by the first :class:`Event` made while no :class:`EventCalls` is in use;\n"
"it calls :func:`use_event_calls`.");

static PyObject *set_event_calls_loader(PyObject *self, PyObject *loader)
{
    (void)self;
    if (!PyCallable_Check(loader)) {
        PyErr_SetString(PyExc_TypeError, "set_event_calls_loader: a callable");
        return NULL;
    }
    Py_INCREF(loader);
    Py_XSETREF(event_calls_loader, loader);
    Py_RETURN_NONE;
}

/* -- module --------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"memcpy_pieces", (PyCFunction)(void (*)(void))memcpy_pieces, METH_FASTCALL, memcpy_pieces_doc},
    {"enqueue_pieces", (PyCFunction)(void (*)(void))enqueue_pieces, METH_FASTCALL, enqueue_pieces_doc},
    {"enqueue_runs", (PyCFunction)(void (*)(void))enqueue_runs, METH_FASTCALL, enqueue_runs_doc},
    {"enqueue_ring", (PyCFunction)(void (*)(void))enqueue_ring, METH_FASTCALL, enqueue_ring_doc},
    {"context_status", (PyCFunction)context_status, METH_O, context_status_doc},
    {"use_event_calls", (PyCFunction)use_event_calls, METH_O, use_event_calls_doc},
    {"set_event_calls_loader", (PyCFunction)set_event_calls_loader, METH_O, set_event_calls_loader_doc},
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
    if (PyType_Ready(&ChunkCopiesType) < 0 || PyType_Ready(&EventCallsType) < 0 || PyType_Ready(&EventType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    PyTypeObject *types[] = {&ChunkCopiesType, &EventCallsType, &EventType};
    const char *names[] = {"ChunkCopies", "EventCalls", "Event"};
    for (int i = 0; i < 3; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
