/* POSIX semaphores that a thread sleeps on until something rings them: another thread, or the
 * CUDA driver through a host function (sem_post itself, RING_FUNCTION), with no Python run on the
 * sleeper's behalf. The memory of each semaphore is the caller's (it must outlive every ring
 * enqueued for it).
 *
 * A sleeper usually sleeps with the GIL released. It can also learn how long it then waited to
 * take the GIL back: behind a thread running Python that is up to the interpreter's switch
 * interval, and a sleeper that knows it paid one can keep the GIL for a short second sleep rather
 * than pay another.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <semaphore.h>
#include <stdint.h>
#include <time.h>

static int address_of(PyObject *arg, sem_t **sem)
{
    uintptr_t address = (uintptr_t)PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) {
        return -1;
    }
    if (address == 0) {
        PyErr_SetString(PyExc_ValueError, "wake semaphore: the address is 0");
        return -1;
    }
    *sem = (sem_t *)address;
    return 0;
}

/* 1 once rung, 0 at the deadline (a signal's EINTR sleeps on) */
static int rung_by(sem_t *sem, const struct timespec *deadline)
{
#ifdef __APPLE__ /* no sem_timedwait; init() refuses, so no semaphore gets here */
    (void)sem;
    (void)deadline;
    return 0;
#else
    while (sem_timedwait(sem, deadline) != 0) {
        if (errno != EINTR) {
            return 0;
        }
    }
    return 1;
#endif
}

static double seconds_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

PyDoc_STRVAR(init_doc, "init(address, /) -> None\n\n"
"Make a semaphore (count 0, this process only) in the ``sizeof(sem_t)`` bytes at ``address``; "
"``OSError`` where the system has none.");

static PyObject *init(PyObject *self, PyObject *arg)
{
    (void)self;
    sem_t *sem;
    if (address_of(arg, &sem) < 0) {
        return NULL;
    }
#ifdef __APPLE__
    errno = ENOSYS; /* unnamed semaphores are not implemented there */
    return PyErr_SetFromErrno(PyExc_OSError);
#else
    if (sem_init(sem, 0, 0) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
#endif
}

PyDoc_STRVAR(ring_doc, "ring(address, /) -> None\n\nWake the semaphore's sleeper (the next one, if none sleeps now); keeps the GIL.");

static PyObject *ring(PyObject *self, PyObject *arg)
{
    (void)self;
    sem_t *sem;
    if (address_of(arg, &sem) < 0) {
        return NULL;
    }
    if (sem_post(sem) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(drain_doc, "drain(address, /) -> int\n\n"
"Take back every ring the semaphore has had and no sleeper took (how many), without sleeping; keeps the GIL.");

static PyObject *drain(PyObject *self, PyObject *arg)
{
    (void)self;
    sem_t *sem;
    if (address_of(arg, &sem) < 0) {
        return NULL;
    }
    long n = 0;
    while (sem_trywait(sem) == 0) {
        n++;
    }
    if (errno != EAGAIN && errno != EINTR) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(n);
}

PyDoc_STRVAR(sleep_doc, "sleep(address, timeout, keep_gil, /) -> float | None\n\n"
"Sleep until the semaphore is rung or ``timeout`` seconds pass: None if not rung, else the seconds "
"the thread then waited to take the GIL back. ``keep_gil``: sleep holding the GIL (every other "
"thread's Python waits meanwhile; keep such a sleep short), and the wait is 0.0.");

static PyObject *sleep_on(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sleep takes 3 arguments");
        return NULL;
    }
    sem_t *sem;
    if (address_of(args[0], &sem) < 0) {
        return NULL;
    }
    double timeout = PyFloat_AsDouble(args[1]);
    if (timeout == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    int keep_gil = PyObject_IsTrue(args[2]);
    if (keep_gil < 0) {
        return NULL;
    }
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline); /* sem_timedwait's clock */
    if (timeout > 1e9) {
        timeout = 1e9; /* about 30 years: no overflow below */
    }
    if (timeout > 0) {
        double whole = (double)(long long)timeout;
        deadline.tv_sec += (time_t)whole;
        deadline.tv_nsec += (long)((timeout - whole) * 1e9);
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec += 1;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    int rung;
    double woken = 0.0, gil_wait = 0.0;
    if (keep_gil) {
        rung = rung_by(sem, &deadline);
    } else {
        Py_BEGIN_ALLOW_THREADS
        rung = rung_by(sem, &deadline);
        woken = seconds_now();
        Py_END_ALLOW_THREADS
        gil_wait = seconds_now() - woken;
    }
    if (!rung) {
        Py_RETURN_NONE;
    }
    return PyFloat_FromDouble(gil_wait);
}

static PyMethodDef methods[] = {
    {"init", init, METH_O, init_doc},
    {"ring", ring, METH_O, ring_doc},
    {"drain", drain, METH_O, drain_doc},
    {"sleep", (PyCFunction)(void (*)(void))sleep_on, METH_FASTCALL, sleep_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload._core.base.wake_semaphores",
    .m_doc = "POSIX semaphores a thread sleeps on until another thread or the CUDA driver rings them.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit_wake_semaphores(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    /* void (*)(void *): what a host function on a stream calls with the semaphore's address */
    if (PyModule_AddObject(m, "RING_FUNCTION", PyLong_FromUnsignedLongLong((uintptr_t)(void *)&sem_post)) < 0
        || PyModule_AddIntConstant(m, "SEMAPHORE_BYTES", (long)sizeof(sem_t)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
