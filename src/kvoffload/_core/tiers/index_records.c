/* The index's records and its per-key steps, at C speed.
 *
 * Entry (one key's block) and Pin (a load's or a lease's hold on one entry's copy) are plain
 * records whose fields Python reads and writes as attributes. The functions below are the steps
 * the index makes for every key of a store or a load; ``index.py`` calls them under its lock and
 * keeps everything else (spills, evictions, promotions, leases, repair after an interrupt). Each
 * step on one key is whole before the next key's begins, and no Python code runs inside a call,
 * so a signal handler's exception can land only between calls, never between the fields of one
 * key: ``index.py``'s repair after an interrupt sees each key done or not done.
 *
 * The records are not tracked by the cyclic garbage collector: an Entry holds its key (native: bytes,
 * str, int, tuples of them) and its state (a State member), a Pin its entry, so no cycle runs through
 * them, and a store or load makes a dozen of them without adding to the collector's count.
 *
 * The tiers' state these steps change is passed in by the caller, as the index holds it: per tier
 * (indexed by the tier's number) a list of reader counts, a list of owners and an OrderedDict of
 * visible entries, least recently used first; the entry states are the ``State`` members.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdlib.h>

/* -- Entry ---------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *key;
    PyObject *state;
    Py_ssize_t tier;
    Py_ssize_t slot;
    Py_ssize_t loads;
    Py_ssize_t clean_slot;
} EntryObject;

static PyTypeObject EntryType;

static EntryObject *entry_make(PyObject *key, PyObject *state, Py_ssize_t tier, Py_ssize_t slot)
{
    EntryObject *e = PyObject_New(EntryObject, &EntryType);
    if (e == NULL) {
        return NULL;
    }
    Py_INCREF(key);
    Py_INCREF(state);
    e->key = key;
    e->state = state;
    e->tier = tier;
    e->slot = slot;
    e->loads = 0;
    e->clean_slot = -1;
    return e;
}

static PyObject *entry_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"key", "state", "tier", "slot", "loads", "clean_slot", NULL};
    PyObject *key, *state;
    Py_ssize_t tier, slot, loads = 0, clean_slot = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOnn|nn:Entry", names, &key, &state, &tier, &slot, &loads, &clean_slot)) {
        return NULL;
    }
    (void)type;
    EntryObject *e = entry_make(key, state, tier, slot);
    if (e != NULL) {
        e->loads = loads;
        e->clean_slot = clean_slot;
    }
    return (PyObject *)e;
}

static void entry_dealloc(EntryObject *e)
{
    Py_XDECREF(e->key);
    Py_XDECREF(e->state);
    PyObject_Del(e);
}

static PyObject *entry_repr(EntryObject *e)
{
    return PyUnicode_FromFormat("Entry(key=%R, state=%R, tier=%zd, slot=%zd, loads=%zd, clean_slot=%zd)", e->key ? e->key : Py_None,
                                e->state ? e->state : Py_None, e->tier, e->slot, e->loads, e->clean_slot);
}

static PyMemberDef entry_members[] = {
    {"key", T_OBJECT_EX, offsetof(EntryObject, key), READONLY, "The key, as the store that made the entry passed it."},
    {"state", T_OBJECT_EX, offsetof(EntryObject, state), 0, "Its State."},
    {"tier", T_PYSSIZET, offsetof(EntryObject, tier), 0, "The tier of its current copy (HOST or DISK)."},
    {"slot", T_PYSSIZET, offsetof(EntryObject, slot), 0, "The slot of its current copy in that tier (-1: none yet)."},
    {"loads", T_PYSSIZET, offsetof(EntryObject, loads), 0, "Running loads and leases that pinned it (for stats().pinned)."},
    {"clean_slot", T_PYSSIZET, offsetof(EntryObject, clean_slot), 0,
     "A READY host entry's clean disk copy: the disk slot it was promoted from, still its own and holding its bytes "
     "unchanged; -1: none."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload._core.tiers.index_records.Entry",
    .tp_doc = "Entry(key, state, tier, slot, loads=0, clean_slot=-1): one key's block: its state, and the tier and slot "
              "where loads find it.",
    .tp_basicsize = sizeof(EntryObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = entry_new,
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_repr = (reprfunc)entry_repr,
    .tp_members = entry_members,
};

/* -- Pin ------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *entry;
    Py_ssize_t tier;
    Py_ssize_t slot;
    char held;
    char promoted;
    Py_ssize_t promote_slot;
} PinObject;

static PyTypeObject PinType;

static PinObject *pin_make(PyObject *entry, Py_ssize_t tier, Py_ssize_t slot)
{
    PinObject *p = PyObject_New(PinObject, &PinType);
    if (p == NULL) {
        return NULL;
    }
    Py_INCREF(entry);
    p->entry = entry;
    p->tier = tier;
    p->slot = slot;
    p->held = 0;
    p->promoted = 0;
    p->promote_slot = -1;
    return p;
}

static PyObject *pin_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"entry", "tier", "slot", "held", "promote_slot", "promoted", NULL};
    PyObject *entry;
    Py_ssize_t tier, slot, promote_slot = -1;
    int held = 0, promoted = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Onn|pnp:Pin", names, &entry, &tier, &slot, &held, &promote_slot, &promoted)) {
        return NULL;
    }
    (void)type;
    PinObject *p = pin_make(entry, tier, slot);
    if (p != NULL) {
        p->held = (char)held;
        p->promote_slot = promote_slot;
        p->promoted = (char)promoted;
    }
    return (PyObject *)p;
}

static void pin_dealloc(PinObject *p)
{
    Py_XDECREF(p->entry);
    PyObject_Del(p);
}

static PyObject *pin_repr(PinObject *p)
{
    return PyUnicode_FromFormat("Pin(entry=%R, tier=%zd, slot=%zd, held=%s, promote_slot=%zd, promoted=%s)", p->entry ? p->entry : Py_None,
                                p->tier, p->slot, p->held ? "True" : "False", p->promote_slot, p->promoted ? "True" : "False");
}

static PyMemberDef pin_members[] = {
    {"entry", T_OBJECT_EX, offsetof(PinObject, entry), READONLY, "The entry whose copy it holds."},
    {"tier", T_PYSSIZET, offsetof(PinObject, tier), 0, "The tier of the copy it reads."},
    {"slot", T_PYSSIZET, offsetof(PinObject, slot), 0, "The slot it reads (or will)."},
    {"held", T_BOOL, offsetof(PinObject, held), 0,
     "True once the slot's reader count includes this pin (set in the same step as the count)."},
    {"promote_slot", T_PYSSIZET, offsetof(PinObject, promote_slot), 0,
     "A load's promotion: the free host slot its disk copy is read into, as a reader of it with no owner until "
     "BlockIndex.promotion_done gives it to the entry; -1: none (or taken back by a store before the read started)."},
    {"promoted", T_BOOL, offsetof(PinObject, promoted), 0, "True once the entry took promote_slot as its host copy."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject PinType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload._core.tiers.index_records.Pin",
    .tp_doc = "Pin(entry, tier, slot, held=False, promote_slot=-1, promoted=False): a load's or a lease's hold on one "
              "entry's copy: the slot it reads (or will).",
    .tp_basicsize = sizeof(PinObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = pin_new,
    .tp_dealloc = (destructor)pin_dealloc,
    .tp_repr = (reprfunc)pin_repr,
    .tp_members = pin_members,
};

/* -- helpers -------------------------------------------------------------------------------- */

static PyObject *str_move_to_end, *str_entries;

/* Tier ``t``'s item of the tuple ``per_tier`` (its reader counts, owners or LRU: ``what``), borrowed. */
static PyObject *tier_item(PyObject *per_tier, Py_ssize_t t, const char *what)
{
    if (!PyTuple_Check(per_tier) || t < 0 || t >= PyTuple_GET_SIZE(per_tier)) {
        PyErr_Format(PyExc_ValueError, "no %s for tier %zd", what, t);
        return NULL;
    }
    return PyTuple_GET_ITEM(per_tier, t);
}

/* list[slot] += delta for a list of ints; -1 and an exception on failure (nothing changed). */
static int add_to_count(PyObject *list, Py_ssize_t slot, long delta, long *now)
{
    if (!PyList_Check(list) || slot < 0 || slot >= PyList_GET_SIZE(list)) {
        PyErr_Format(PyExc_IndexError, "slot %zd out of range", slot);
        return -1;
    }
    long value = PyLong_AsLong(PyList_GET_ITEM(list, slot));
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    PyObject *n = PyLong_FromLong(value + delta);
    if (n == NULL) {
        return -1;
    }
    PyList_SetItem(list, slot, n); /* steals n; the index is valid: cannot fail */
    if (now != NULL) {
        *now = value + delta;
    }
    return 0;
}

/* 0, or -1 and a TypeError unless a function that takes ``want`` arguments got them (piece_copies.c's
 * twin: each extension builds on its own). */
static int check_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

static int check_list(PyObject *o, const char *what)
{
    if (!PyList_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list", what);
        return -1;
    }
    return 0;
}

/* -- the steps ------------------------------------------------------------------------------ */

PyDoc_STRVAR(find_visible_doc,
"find_visible(entries, keys, ready, spilling, /) -> (found, missing)\n\n"
"Each key's entry in the dict ``entries`` (in key order), and the keys without a visible one (no entry, or one\n"
"whose state is neither ``ready`` nor ``spilling``). Keys are native: no caller code runs.");

static PyObject *find_visible(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_nargs(nargs, 4, "find_visible") < 0) {
        return NULL;
    }
    PyObject *entries = args[0], *keys = args[1], *ready = args[2], *spilling = args[3];
    if (!PyDict_Check(entries) || check_list(keys, "keys") < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "entries must be a dict");
        }
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *found = PyList_New(n);
    PyObject *missing = PyList_New(0);
    if (found == NULL || missing == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        PyObject *e = PyDict_GetItemWithError(entries, key);
        if (e == NULL && PyErr_Occurred()) {
            goto fail;
        }
        if (e == NULL || Py_TYPE(e) != &EntryType
            || (((EntryObject *)e)->state != ready && ((EntryObject *)e)->state != spilling)) {
            if (PyList_Append(missing, key) < 0) {
                goto fail;
            }
        }
        e = e != NULL ? e : Py_None;
        Py_INCREF(e);
        PyList_SET_ITEM(found, i, e);
    }
    PyObject *out = PyTuple_Pack(2, found, missing);
    Py_DECREF(found);
    Py_DECREF(missing);
    return out;
fail:
    Py_XDECREF(found);
    Py_XDECREF(missing);
    return NULL;
}

PyDoc_STRVAR(pin_entries_doc,
"pin_entries(found, pins, readers, lrus, /) -> None\n\n"
"Pin each entry of ``found`` (visible, none taken over): a Pin of its current copy appended to ``pins``, then,\n"
"in one step, its slot's reader count and the entry's ``loads`` up by one and the pin held; the entry becomes\n"
"its tier's most recently used. ``readers`` and ``lrus``: per tier, the reader counts and the LRU OrderedDict.\n"
"On an error the pins appended so far are held (the caller gives back the held ones).");

static PyObject *pin_entries(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_nargs(nargs, 4, "pin_entries") < 0) {
        return NULL;
    }
    PyObject *found = args[0], *pins = args[1], *readers = args[2], *lrus = args[3];
    if (check_list(found, "found") < 0 || check_list(pins, "pins") < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(found); i++) {
        PyObject *o = PyList_GET_ITEM(found, i);
        if (Py_TYPE(o) != &EntryType) {
            PyErr_SetString(PyExc_TypeError, "pin_entries: not an Entry");
            return NULL;
        }
        EntryObject *e = (EntryObject *)o;
        PyObject *counts = tier_item(readers, e->tier, "reader counts");
        PyObject *lru = tier_item(lrus, e->tier, "LRU");
        if (counts == NULL || lru == NULL) {
            return NULL;
        }
        PinObject *p = pin_make(o, e->tier, e->slot);
        if (p == NULL) {
            return NULL;
        }
        int appended = PyList_Append(pins, (PyObject *)p);
        Py_DECREF(p);
        if (appended < 0 || add_to_count(counts, e->slot, 1, NULL) < 0) {
            return NULL; /* appended, not held: the caller skips it */
        }
        e->loads += 1;
        p->held = 1; /* with the count: one step */
        PyObject *r = PyObject_CallMethodOneArg(lru, str_move_to_end, e->key);
        if (r == NULL) {
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(unpin_pins_doc,
"unpin_pins(pins, readers, owners, waiters, /) -> (last_readers, promoting) or None\n\n"
"Let go of each held pin of ``pins``, in one step each: not held any more, its slot's reader count and its\n"
"entry's ``loads`` down by one. Returns None when nothing is left to the caller; else ``last_readers``, the\n"
"``(tier, slot)`` pairs whose last reader left while the slot is unowned or ``waiters`` (a dict) is not empty,\n"
"and ``promoting``, the pins with a promotion slot (``promote_slot >= 0``), both for the caller to finish.");

static PyObject *unpin_pins(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_nargs(nargs, 4, "unpin_pins") < 0) {
        return NULL;
    }
    PyObject *pins = args[0], *readers = args[1], *owners = args[2], *waiters = args[3];
    PyObject *seq = PySequence_Fast(pins, "pins must be iterable");
    if (seq == NULL) {
        return NULL;
    }
    int anyone_waits = PyDict_Check(waiters) && PyDict_GET_SIZE(waiters) > 0;
    PyObject *last = NULL, *promoting = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_TYPE(items[i]) != &PinType) {
            PyErr_SetString(PyExc_TypeError, "unpin_pins: not a Pin");
            goto fail;
        }
        PinObject *p = (PinObject *)items[i];
        if (p->held) {
            PyObject *counts = tier_item(readers, p->tier, "reader counts");
            PyObject *owner = tier_item(owners, p->tier, "owners");
            long now;
            if (counts == NULL || owner == NULL || add_to_count(counts, p->slot, -1, &now) < 0) {
                goto fail;
            }
            p->held = 0; /* with the count: one step */
            if (Py_TYPE(p->entry) == &EntryType) {
                ((EntryObject *)p->entry)->loads -= 1;
            }
            if (now == 0 && (!PyList_Check(owner) || p->slot >= PyList_GET_SIZE(owner) || PyList_GET_ITEM(owner, p->slot) == Py_None
                             || anyone_waits)) {
                PyObject *pair = Py_BuildValue("(nn)", p->tier, p->slot);
                if (pair == NULL) {
                    goto fail; /* this pin is let go; its slot left to the caller's repair */
                }
                if (last == NULL && (last = PyList_New(0)) == NULL) {
                    Py_DECREF(pair);
                    goto fail;
                }
                int appended = PyList_Append(last, pair);
                Py_DECREF(pair);
                if (appended < 0) {
                    goto fail;
                }
            }
        }
        if (p->promote_slot >= 0) {
            if (promoting == NULL && (promoting = PyList_New(0)) == NULL) {
                goto fail;
            }
            if (PyList_Append(promoting, (PyObject *)p) < 0) {
                goto fail;
            }
        }
    }
    Py_DECREF(seq);
    if (last == NULL && promoting == NULL) {
        Py_RETURN_NONE;
    }
    if ((last == NULL && (last = PyList_New(0)) == NULL) || (promoting == NULL && (promoting = PyList_New(0)) == NULL)) {
        Py_XDECREF(last);
        Py_XDECREF(promoting);
        return NULL;
    }
    return Py_BuildValue("(NN)", last, promoting);
fail:
    Py_DECREF(seq);
    Py_XDECREF(last);
    Py_XDECREF(promoting);
    return NULL;
}

PyDoc_STRVAR(new_entries_doc,
"new_entries(keys, state, tier, /) -> list[Entry]\n\n"
"An Entry per key of the list ``keys``, in ``state`` and ``tier``, with no slot yet (-1).");

static PyObject *new_entries(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_nargs(nargs, 3, "new_entries") < 0) {
        return NULL;
    }
    if (check_list(args[0], "keys") < 0) {
        return NULL;
    }
    Py_ssize_t tier = PyLong_AsSsize_t(args[2]);
    if (tier == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        EntryObject *e = entry_make(PyList_GET_ITEM(args[0], i), args[1], tier, -1);
        if (e == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, (PyObject *)e);
    }
    return out;
}

PyDoc_STRVAR(own_slots_doc,
"own_slots(entries, slots, owner, /) -> None\n\n"
"Entry ``entries[i]`` takes slot ``slots[i]``: its ``slot`` field and ``owner[slot]``, in one step each.");

static PyObject *own_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_nargs(nargs, 3, "own_slots") < 0) {
        return NULL;
    }
    PyObject *entries = args[0], *slots = args[1], *owner = args[2];
    if (check_list(entries, "entries") < 0 || check_list(slots, "slots") < 0 || check_list(owner, "owner") < 0) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(entries) < PyList_GET_SIZE(slots) ? PyList_GET_SIZE(entries) : PyList_GET_SIZE(slots);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(entries, i);
        Py_ssize_t slot = PyLong_AsSsize_t(PyList_GET_ITEM(slots, i));
        if (slot == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (Py_TYPE(o) != &EntryType || slot < 0 || slot >= PyList_GET_SIZE(owner)) {
            PyErr_SetString(PyExc_ValueError, "own_slots: not an Entry, or a slot out of range");
            return NULL;
        }
        Py_INCREF(o);
        PyList_SetItem(owner, slot, o); /* steals o, drops the old owner: None */
        ((EntryObject *)o)->slot = slot;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(publish_entries_doc,
"publish_entries(entries, lrus, pending, ready, /) -> list[Entry] or None\n\n"
"Each ``pending`` entry of ``entries`` becomes ``ready`` and its tier's most recently used, in one step\n"
"each. Returns the others (discarded while their store ran: their slots are the caller's to release), or\n"
"None when there are none.");

static PyObject *publish_entries(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_nargs(nargs, 4, "publish_entries") < 0) {
        return NULL;
    }
    PyObject *lrus = args[1], *pending = args[2], *ready = args[3];
    PyObject *seq = PySequence_Fast(args[0], "entries must be iterable");
    if (seq == NULL) {
        return NULL;
    }
    PyObject *others = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_TYPE(items[i]) != &EntryType) {
            PyErr_SetString(PyExc_TypeError, "publish_entries: not an Entry");
            goto fail;
        }
        EntryObject *e = (EntryObject *)items[i];
        if (e->state == pending) {
            PyObject *lru = tier_item(lrus, e->tier, "LRU");
            if (lru == NULL || PyObject_SetItem(lru, e->key, (PyObject *)e) < 0) {
                goto fail;
            }
            Py_INCREF(ready);
            Py_XSETREF(e->state, ready);
        } else {
            if (others == NULL && (others = PyList_New(0)) == NULL) {
                goto fail;
            }
            if (PyList_Append(others, (PyObject *)e) < 0) {
                goto fail;
            }
        }
    }
    Py_DECREF(seq);
    if (others == NULL) {
        Py_RETURN_NONE;
    }
    return others;
fail:
    Py_DECREF(seq);
    Py_XDECREF(others);
    return NULL;
}


PyDoc_STRVAR(reserve_free_doc,
"reserve_free(keys, entries, free, owner, pending, tier, into, /) -> bool\n\n"
"The usual store's reservation, in one step: where ``keys`` (a dict) are all new (none in the dict\n"
"``entries``) and at least as many slots are free, a ``pending`` Entry per key, in key order, takes the last\n"
"free slots of the list ``free`` in ascending order (``owner[slot]``), ``entries`` lists it, and ``into.entries``\n"
"is the list of them: True. Else False, and nothing changed: the caller's general path decides.");

static int by_slot(const void *a, const void *b)
{
    Py_ssize_t x = *(const Py_ssize_t *)a, y = *(const Py_ssize_t *)b;
    return (x > y) - (x < y);
}

static PyObject *reserve_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_nargs(nargs, 7, "reserve_free") < 0) {
        return NULL;
    }
    PyObject *keys = args[0], *entries = args[1], *free = args[2], *owner = args[3], *pending = args[4], *into = args[6];
    Py_ssize_t tier = PyLong_AsSsize_t(args[5]);
    if (tier == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyDict_CheckExact(keys) || !PyDict_Check(entries) || !PyList_Check(free) || !PyList_Check(owner)) {
        Py_RETURN_FALSE;
    }
    Py_ssize_t n = PyDict_GET_SIZE(keys), nfree = PyList_GET_SIZE(free);
    if (n == 0 || n > nfree) {
        Py_RETURN_FALSE;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(keys, &pos, &key, &value)) {
        int present = PyDict_Contains(entries, key);
        if (present < 0) {
            return NULL;
        }
        if (present) {
            Py_RETURN_FALSE;
        }
    }
    Py_ssize_t *slots = PyMem_New(Py_ssize_t, n);
    if (slots == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        slots[i] = PyLong_AsSsize_t(PyList_GET_ITEM(free, nfree - n + i));
        if ((slots[i] == -1 && PyErr_Occurred()) || slots[i] < 0 || slots[i] >= PyList_GET_SIZE(owner) || PyList_GET_ITEM(owner, slots[i]) != Py_None) {
            PyMem_Free(slots);
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "reserve_free: a free slot out of range or owned");
            }
            return NULL;
        }
    }
    qsort(slots, (size_t)n, sizeof *slots, by_slot);
    PyObject *out = PyList_New(n); /* the entries, made before anything changes */
    if (out == NULL) {
        PyMem_Free(slots);
        return NULL;
    }
    pos = 0;
    for (Py_ssize_t i = 0; PyDict_Next(keys, &pos, &key, &value); i++) {
        EntryObject *e = entry_make(key, pending, tier, slots[i]);
        if (e == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, i, (PyObject *)e);
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* listed: undone on a failure (a deletion allocates nothing) */
        EntryObject *e = (EntryObject *)PyList_GET_ITEM(out, i);
        if (PyDict_SetItem(entries, e->key, (PyObject *)e) < 0) {
            for (Py_ssize_t j = 0; j < i; j++) {
                PyDict_DelItem(entries, ((EntryObject *)PyList_GET_ITEM(out, j))->key);
            }
            goto fail;
        }
    }
    PyObject *before = PyObject_GetAttr(into, str_entries);
    if (before == NULL || PyObject_SetAttr(into, str_entries, out) < 0 || PyList_SetSlice(free, nfree - n, nfree, NULL) < 0) {
        if (before != NULL) {
            PyObject *error, *kind, *trace;
            PyErr_Fetch(&kind, &error, &trace);
            PyObject_SetAttr(into, str_entries, before); /* replaces a value: allocates nothing */
            PyErr_Restore(kind, error, trace);
        }
        Py_XDECREF(before);
        for (Py_ssize_t j = 0; j < n; j++) {
            PyDict_DelItem(entries, ((EntryObject *)PyList_GET_ITEM(out, j))->key);
        }
        goto fail;
    }
    Py_DECREF(before);
    for (Py_ssize_t i = 0; i < n; i++) { /* cannot fail */
        PyObject *e = PyList_GET_ITEM(out, i);
        Py_INCREF(e);
        PyList_SetItem(owner, slots[i], e);
    }
    PyMem_Free(slots);
    Py_DECREF(out);
    Py_RETURN_TRUE;
fail:
    PyMem_Free(slots);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"find_visible", (PyCFunction)(void (*)(void))find_visible, METH_FASTCALL, find_visible_doc},
    {"pin_entries", (PyCFunction)(void (*)(void))pin_entries, METH_FASTCALL, pin_entries_doc},
    {"unpin_pins", (PyCFunction)(void (*)(void))unpin_pins, METH_FASTCALL, unpin_pins_doc},
    {"reserve_free", (PyCFunction)(void (*)(void))reserve_free, METH_FASTCALL, reserve_free_doc},
    {"new_entries", (PyCFunction)(void (*)(void))new_entries, METH_FASTCALL, new_entries_doc},
    {"own_slots", (PyCFunction)(void (*)(void))own_slots, METH_FASTCALL, own_slots_doc},
    {"publish_entries", (PyCFunction)(void (*)(void))publish_entries, METH_FASTCALL, publish_entries_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload._core.tiers.index_records",
    .m_doc = "The index's records (Entry, Pin) and its per-key steps, at C speed.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit_index_records(void)
{
    if (PyType_Ready(&EntryType) < 0 || PyType_Ready(&PinType) < 0) {
        return NULL;
    }
    str_move_to_end = PyUnicode_InternFromString("move_to_end");
    str_entries = PyUnicode_InternFromString("entries");
    if (str_move_to_end == NULL || str_entries == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&EntryType);
    Py_INCREF(&PinType);
    if (PyModule_AddObject(m, "Entry", (PyObject *)&EntryType) < 0 || PyModule_AddObject(m, "Pin", (PyObject *)&PinType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
