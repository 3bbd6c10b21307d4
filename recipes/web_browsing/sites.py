"""Procedural SaaS sites: word lists and page builders.

A site is plain JSON-able data, so that a task's payload holds all of it:

    {"brand": "Pine Cloud", "start": "home",
     "pages": {"home": {"title": "Dashboard", "kind": "home", "elements": [...]}, ...}}

An element is a dict with a `role` (link, button, textbox, combobox, checkbox, row,
text), a `label`, an `id` (all but text), a `value` (fields; a bool for checkboxes),
`options` (comboboxes) and `to` (links and buttons that open another page). Buttons
without `to` are actions: pressing one ends the episode. Generation may add keys that the
page does not show (`submit` on the button that sends a form).

Brands are split between train and eval by a hash of the name, so the two splits never
share a site. Element ids are small integers drawn at random per page.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field

BRAND_PREFIXES = (
    "Acme", "Nimbus", "Orbit", "Pine", "Quartz", "Falcon", "Harbor", "Juniper", "Kite",
    "Lumen", "Maple", "Nova", "Onyx", "Pulse", "Ridge", "Summit", "Tidal", "Vertex",
    "Willow", "Zephyr", "Cobalt", "Delta", "Ember", "Fjord", "Granite", "Helix", "Iris",
    "Jasper", "Lattice", "Meadow", "Nexus", "Opal", "Prism", "Raven", "Sable", "Terra",
    "Vista", "Wren", "Birch", "Cedar",
)  # fmt: skip
BRAND_SUFFIXES = (
    "Cloud", "CRM", "Analytics", "Mail", "Pay", "Desk", "Docs", "Hub", "Ops", "Metrics",
    "Notes", "Forms", "Ship", "Track", "Chat", "Store", "Books", "Sign", "Host", "Base",
)  # fmt: skip
EVAL_SHARE = 5  # one brand in 5 belongs to the eval split

FIRST_NAMES = (
    "Ana", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas",
    "Kira", "Liam", "Maria", "Noah", "Olga", "Pavel", "Rosa", "Sami", "Tara", "Victor",
)  # fmt: skip
LAST_NAMES = (
    "Lopez", "Smith", "Novak", "Rossi", "Khan", "Meyer", "Silva", "Tanaka", "Dubois",
    "Berg", "Costa", "Ivanov", "Moreau", "Ortiz", "Quinn", "Weber",
)  # fmt: skip
WORDS = (
    "amber", "blue", "coral", "delta", "ember", "frost", "green", "harbor", "indigo",
    "jade", "lunar", "misty", "north", "olive", "polar", "quiet", "rapid", "solar",
)  # fmt: skip
REGIONS = ("us-east-1", "us-west-2", "eu-west-1", "eu-central-1", "ap-south-1")

# Click targets are "<Verb> <object>"; goals at the synonym level use one of the verb's
# phrasings instead, so "Remove the draft." means the button "Delete draft".
ACTION_VERBS: dict[str, tuple[str, ...]] = {
    "Delete": ("Remove the {o}", "Erase the {o}"),
    "Archive": ("Shelve the {o}", "Put the {o} in storage"),
    "Rename": ("Change the name of the {o}", "Give the {o} a new name"),
    "Duplicate": ("Make a copy of the {o}", "Clone the {o}"),
    "Download": ("Fetch the {o}", "Save the {o} to your computer"),
    "Create": ("Make a new {o}", "Set up a new {o}"),
    "Edit": ("Modify the {o}", "Make changes to the {o}"),
    "Pause": ("Suspend the {o}", "Put the {o} on hold"),
    "Restore": ("Recover the {o}", "Bring back the {o}"),
}
ACTION_OBJECTS = (
    "project", "report", "invoice", "draft", "account", "workspace",
    "webhook", "API key", "backup", "dashboard", "domain", "schedule",
)  # fmt: skip
CLICK_TITLES = ("Projects", "Reports", "Files", "Workspace", "Admin", "Overview")

SUBMIT_LABELS = ("Save", "Save changes", "Update", "Apply")
FORM_DISTRACTORS = ("Cancel", "Reset form", "Discard changes")


@dataclass(frozen=True)
class FieldSpec:
    """A form field: its role, label, and where its values come from (a tuple of
    options for comboboxes, a generator name for textboxes, nothing for checkboxes)."""

    role: str
    label: str
    source: tuple[str, ...] | str = ()


def _f(role: str, label: str, source: tuple[str, ...] | str = ()) -> FieldSpec:
    return FieldSpec(role, label, source)


# Labels are unique across topics (a goal can name a field without naming its page);
# each topic holds near-labels ("Email" / "Backup email") and every role.
FORM_TOPICS: dict[str, tuple[FieldSpec, ...]] = {
    "Profile": (
        _f("textbox", "Full name", "person"),
        _f("textbox", "Display name", "handle"),
        _f("textbox", "Email", "email"),
        _f("textbox", "Backup email", "email"),
        _f("combobox", "Language", ("English", "French", "German", "Spanish")),
        _f("combobox", "Time zone", ("UTC", "CET", "EST", "PST")),
        _f("checkbox", "Public profile"),
    ),
    "Notifications": (
        _f("checkbox", "Email alerts"),
        _f("checkbox", "SMS alerts"),
        _f("checkbox", "Weekly digest"),
        _f("checkbox", "Monthly digest"),
        _f("combobox", "Alert level", ("All", "Important", "None")),
        _f("textbox", "Alert email", "email"),
        _f("textbox", "Phone number", "phone"),
    ),
    "Security": (
        _f("checkbox", "Two-factor login"),
        _f("checkbox", "Login alerts"),
        _f("combobox", "Session timeout", ("15 minutes", "1 hour", "8 hours", "24 hours")),
        _f("combobox", "Idle timeout", ("5 minutes", "10 minutes", "30 minutes")),
        _f("textbox", "Recovery email", "email"),
        _f("textbox", "Recovery phone", "phone"),
    ),
    "Workspace": (
        _f("textbox", "Workspace name", "slug"),
        _f("textbox", "Workspace URL", "url"),
        _f("combobox", "Region", REGIONS),
        _f("combobox", "Backup region", REGIONS),
        _f("combobox", "Default role", ("Viewer", "Editor", "Admin")),
        _f("checkbox", "Guest access"),
        _f("checkbox", "Public sharing"),
    ),
    "Plan": (
        _f("combobox", "Plan", ("Free", "Pro", "Team", "Enterprise")),
        _f("textbox", "Billing email", "email"),
        _f("textbox", "Billing contact", "person"),
        _f("combobox", "Currency", ("USD", "EUR", "GBP")),
        _f("textbox", "VAT number", "vat"),
        _f("checkbox", "Auto-renew"),
        _f("checkbox", "Paper invoices"),
    ),
}
SETTINGS_TOPICS = ("Profile", "Notifications", "Security", "Workspace")
MEMBER_FIELDS = (
    _f("combobox", "Role", ("Viewer", "Editor", "Admin", "Owner")),
    _f("checkbox", "Billing access"),
    _f("combobox", "Status", ("Active", "Suspended")),
)
FIELDS: dict[str, FieldSpec] = {
    f.label: f for fields in (*FORM_TOPICS.values(), MEMBER_FIELDS) for f in fields
}


@dataclass(frozen=True)
class FactSpec:
    """A documented fact: the question it answers, the sentence that states it (with
    `{v}` for the value, `{brand}` for the product), and the values it can take."""

    question: str
    sentence: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class Fact:
    """One fact on one page: `value` is the answer, `sentence` bounds the words an
    answer may use (see browser.answer_matches)."""

    page: str
    question: str
    sentence: str
    value: str


FACT_TOPICS: dict[str, tuple[FactSpec, ...]] = {
    "Rate limits": (
        FactSpec("What is the API rate limit?", "The API rate limit is {v} requests per minute.",
                 ("60", "100", "120", "300", "600")),
        FactSpec("What is the maximum upload size?", "The maximum upload size is {v} MB.",
                 ("10", "25", "50", "100", "250")),
        FactSpec("How many webhooks can a workspace have?",
                 "A workspace can have up to {v} webhooks.", ("5", "10", "20", "50")),
        FactSpec("How many API keys can a project have?",
                 "A project can have up to {v} API keys.", ("3", "8", "15", "25")),
    ),
    "Data retention": (
        FactSpec("How long are logs kept?", "Logs are kept for {v} days.", ("7", "14", "30", "90")),
        FactSpec("How long are backups kept?", "Backups are kept for {v} days.",
                 ("60", "120", "180", "365")),
        FactSpec("At what time do backups run?", "Backups run every day at {v} UTC.",
                 ("01:00", "02:30", "03:00", "04:15")),
        FactSpec("How long can a deleted project be restored?",
                 "A deleted project can be restored for {v} days.", ("5", "10", "21", "45")),
    ),
    "Support": (
        FactSpec("What is the support email?", "Write to {v} for help.",
                 ("support@{domain}", "help@{domain}", "care@{domain}")),
        FactSpec("When is support available?", "Support is available {v}.",
                 ("24/7", "on weekdays", "from 9am to 5pm")),
        FactSpec("Where is the status page?", "Service status is shown at {v}.",
                 ("status.{domain}", "health.{domain}")),
        FactSpec("How fast are urgent tickets answered?",
                 "Urgent tickets are answered within {v} hours.", ("1", "2", "4", "8")),
    ),
    "Authentication": (
        FactSpec("How long does an access token last?", "Access tokens expire after {v} minutes.",
                 ("15", "30", "60", "120")),
        FactSpec("Which header carries the API key?", "Send the API key in the {v} header.",
                 ("X-Api-Key", "Authorization", "X-Auth-Token")),
        FactSpec("How many failed logins lock an account?",
                 "An account is locked after {v} failed logins.", ("3", "5", "10")),
        FactSpec("How long is a password reset link valid?",
                 "A password reset link is valid for {v} hours.", ("12", "24", "48")),
    ),
    "Pricing": (
        FactSpec("How much does the Pro plan cost?", "The Pro plan costs {v} per month.",
                 ("$12", "$19", "$29", "$49")),
        FactSpec("How many seats does the Team plan include?", "The Team plan includes {v} seats.",
                 ("5", "10", "25", "50")),
        FactSpec("How long is the free trial?", "The free trial lasts {v} days.",
                 ("7", "14", "30")),
        FactSpec("What discount do yearly plans get?", "Yearly plans get a {v} discount.",
                 ("10%", "15%", "20%", "25%")),
    ),
    "Webhooks": (
        FactSpec("How many times is a failed webhook retried?",
                 "A failed webhook is retried {v} times.", ("3", "5", "8", "10")),
        FactSpec("When does a webhook call time out?",
                 "A webhook call times out after {v} seconds.", ("5", "10", "15", "30")),
        FactSpec("How are webhooks signed?", "Webhooks are signed with {v}.",
                 ("HMAC-SHA256", "HMAC-SHA1", "Ed25519")),
        FactSpec("What is the largest webhook payload?", "A webhook payload can be up to {v} KB.",
                 ("64", "256", "512", "1024")),
    ),
    "Regions": (
        FactSpec("Which region hosts new workspaces?", "New workspaces are created in {v}.",
                 REGIONS),
        FactSpec("How many regions are available?", "{brand} runs in {v} regions.",
                 ("3", "4", "6", "9")),
        FactSpec("Which region stores backups?", "Backups are stored in {v}.", REGIONS),
        FactSpec("What is the uptime target?", "The uptime target is {v}.",
                 ("99.9%", "99.95%", "99.99%")),
    ),
}  # fmt: skip


def brand_split(brand: str) -> str:
    """'train' or 'eval', fixed by the brand name."""
    h = int(hashlib.sha256(brand.encode()).hexdigest()[:8], 16)
    return "eval" if h % EVAL_SHARE == 0 else "train"


BRANDS: dict[str, tuple[str, ...]] = {
    split: tuple(
        f"{p} {s}"
        for p in BRAND_PREFIXES
        for s in BRAND_SUFFIXES
        if brand_split(f"{p} {s}") == split
    )
    for split in ("train", "eval")
}


def site_fingerprint(site: dict) -> str:
    """A digest of everything a site shows and does."""
    return hashlib.sha256(json.dumps(site, sort_keys=True).encode()).hexdigest()[:16]


def action_label(verb: str, obj: str) -> str:
    return f"{verb} {obj}"


def synonym_goal(rng: random.Random, verb: str, obj: str) -> str:
    """The action said without its button's words: ('Delete', 'draft') -> 'Remove the draft'."""
    return rng.choice(ACTION_VERBS[verb]).format(o=obj)


def action_pairs(
    rng: random.Random, n: int, near: bool, objects: tuple[str, ...] = ACTION_OBJECTS
) -> list[tuple[str, str]]:
    """`n` distinct (verb, object) pairs, the first being the target. With `near`, some
    distractors share the target's verb and some its object."""
    verbs = tuple(ACTION_VERBS)
    target = (rng.choice(verbs), rng.choice(objects))
    pairs = [target]
    if near:
        same_verb = [(target[0], o) for o in objects if o != target[1]]
        same_obj = [(v, target[1]) for v in verbs if v != target[0]]
        k = max(1, (n - 1) // 3)
        for group in (same_verb, same_obj):
            pairs += rng.sample(group, min(k, len(group), n - len(pairs)))
    rest = [(v, o) for v in verbs for o in objects if (v, o) not in pairs]
    return pairs + rng.sample(rest, n - len(pairs))


def display_name(label: str) -> str:
    """A label inside a sentence: 'Email alerts' -> 'email alerts', 'SMS alerts' stays."""
    first, _, rest = label.partition(" ")
    if first.isupper():
        return label
    return f"{first.lower()} {rest}".strip()


@dataclass
class SiteBuilder:
    """Collects the pages (and the facts they state) of one site."""

    brand: str
    rng: random.Random
    pages: dict[str, dict] = field(default_factory=dict)
    facts: list[Fact] = field(default_factory=list)

    @property
    def domain(self) -> str:
        return self.brand.split()[0].lower() + ".io"

    def site(self, start: str) -> dict:
        return {"brand": self.brand, "start": start, "pages": self.pages}

    def add(self, key: str, title: str, kind: str, elements: list[dict]) -> dict:
        """Add a page; every element but text gets a distinct random small id."""
        targets = [el for el in elements if el["role"] != "text"]
        ids = self.rng.sample(range(1, 2 * len(targets) + 8), len(targets))
        for el, i in zip(targets, ids):
            el["id"] = i
        page = {"title": title, "kind": kind, "elements": elements}
        self.pages[key] = page
        return page

    # ---- values ----------------------------------------------------------------------

    def person(self) -> str:
        return f"{self.rng.choice(FIRST_NAMES)} {self.rng.choice(LAST_NAMES)}"

    def text_value(self, source: str) -> str:
        """A fresh value for a textbox fed by `source`."""
        rng = self.rng
        if source == "person":
            return self.person()
        if source == "handle":
            return f"{rng.choice(FIRST_NAMES).lower()}{rng.randint(1, 99)}"
        if source == "email":
            return f"{rng.choice(FIRST_NAMES).lower()}@{self.domain}"
        if source == "phone":
            return f"555-{rng.randint(1000, 9999)}"
        if source == "slug":
            return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        if source == "url":
            return f"{rng.choice(WORDS)}.{self.domain}"
        if source == "vat":
            return f"EU{rng.randint(100000, 999999)}"
        raise ValueError(f"unknown value source {source!r}")

    def new_value(self, spec: FieldSpec, current: str | bool) -> str | bool:
        """A value for `spec` that differs from `current`."""
        if spec.role == "checkbox":
            return not current
        if spec.role == "combobox":
            return self.rng.choice([o for o in spec.source if o != current])
        while True:
            value = self.text_value(spec.source)
            if value != current:
                return value

    def field(self, spec: FieldSpec) -> dict:
        """A form element with a random current value."""
        el = {"role": spec.role, "label": spec.label}
        if spec.role == "checkbox":
            el["value"] = self.rng.random() < 0.5
        elif spec.role == "combobox":
            el["options"] = list(spec.source)
            el["value"] = self.rng.choice(spec.source)
        else:
            el["value"] = "" if self.rng.random() < 0.3 else self.text_value(spec.source)
        return el

    # ---- pages -----------------------------------------------------------------------

    def form(
        self, key: str, title: str, specs: list[FieldSpec], submit: str, others: list[str]
    ) -> dict:
        """A form page: the fields in the given order, then its buttons in random order;
        the button that sends the form is marked `submit` (the page does not show it)."""
        buttons = [button(submit) | {"submit": True}, *(button(o) for o in others)]
        self.rng.shuffle(buttons)
        return self.add(key, title, "form", [self.field(s) for s in specs] + buttons)

    def fact_values(self, specs: list[FactSpec]) -> list[str]:
        """One value per fact spec, all different (so that each answer is unambiguous)."""
        values: list[str] = []
        for spec in specs:
            free = [v.format(domain=self.domain) for v in spec.values]
            values.append(self.rng.choice([v for v in free if v not in values]))
        return values

    def article(self, key: str, title: str, specs: list[FactSpec]) -> dict:
        """A documentation page stating one fact per spec, as text lines."""
        elements = []
        for spec, value in zip(specs, self.fact_values(specs)):
            sentence = spec.sentence.format(v=value, brand=self.brand)
            elements.append(text(sentence))
            self.facts.append(Fact(key, spec.question, sentence, value))
        return self.add(key, title, "article", elements)

    def invoices(self, key: str, title: str, n: int, extra: list[dict]) -> dict:
        """A page with an invoice table (one row per invoice), then `extra` elements."""
        rng = self.rng
        numbers = rng.sample(range(1000, 9999), n)
        amounts = rng.sample(range(20, 900), n)
        days = sorted(rng.sample(range(1, 28), n))
        month = rng.randint(1, 9)
        elements = [text("Invoice | Date | Amount | Status")]
        for num, amount, day in zip(numbers, amounts, days):
            inv, date, amt = f"INV-{num}", f"2026-{month:02d}-{day:02d}", f"${amount}"
            status = rng.choice(("Paid", "Due", "Overdue"))
            elements.append(row(f"{inv} | {date} | {amt} | {status}"))
            question, sentence, value = rng.choice(
                (
                    (f"What is the amount of invoice {inv}?", f"Invoice {inv} is for {amt}.", amt),
                    (
                        f"When was invoice {inv} issued?",
                        f"Invoice {inv} was issued on {date}.",
                        date,
                    ),
                )
            )
            self.facts.append(Fact(key, question, sentence, value))
        return self.add(key, title, "table", elements + extra)

    def members(self, n: int) -> list[tuple[str, str, str]]:
        """`n` team members as (name, role, email), first names and roles all different."""
        firsts = self.rng.sample(FIRST_NAMES, n)
        roles = self.rng.sample(MEMBER_FIELDS[0].source, n)
        return [
            (f"{first} {self.rng.choice(LAST_NAMES)}", role, f"{first.lower()}@{self.domain}")
            for first, role in zip(firsts, roles)
        ]

    def member_rows(self, key: str, members: list[tuple[str, str, str]]) -> list[dict]:
        """Table rows for `members`, each stating the member's role and email."""
        elements = [text("Name | Role | Email")]
        for name, role, email in members:
            elements.append(row(f"{name} | {role} | {email}"))
            question, sentence, value = self.rng.choice(
                (
                    (f"What is the role of {name}?", f"The role of {name} is {role}.", role),
                    (f"What is the email of {name}?", f"The email of {name} is {email}.", email),
                )
            )
            self.facts.append(Fact(key, question, sentence, value))
        return elements


def link(label: str, to: str) -> dict:
    return {"role": "link", "label": label, "to": to}


def button(label: str, to: str | None = None) -> dict:
    return {"role": "button", "label": label} | ({"to": to} if to else {})


def text(label: str) -> dict:
    return {"role": "text", "label": label}


def row(label: str) -> dict:
    return {"role": "row", "label": label}


def slug(label: str) -> str:
    return label.lower().replace(" ", "-")


def dashboard(b: SiteBuilder) -> None:
    """The whole app: a dashboard linking to Projects, Billing, Team, Settings and Docs.

    Projects and Billing hold action buttons; Billing > Plan, each Team member and each
    Settings topic is a form; each Docs article states a few facts; Billing's invoice
    table and Team's member table state facts too.
    """
    rng = b.rng
    sections = ["Projects", "Billing", "Team", "Settings", "Docs"]
    rng.shuffle(sections)
    (home_action,) = action_pairs(rng, 1, near=False)
    b.add(
        "home",
        "Dashboard",
        "home",
        [text(f"Welcome back, {rng.choice(FIRST_NAMES)}.")]
        + [link(s, slug(s)) for s in sections]
        + [button(action_label(*home_action))],
    )

    owners = [b.person() for _ in range(3)]
    projects = [
        row(f"{rng.choice(WORDS)}-{rng.choice(WORDS)} | {owner} | {rng.randint(2, 40)} tasks")
        for owner in owners
    ]
    actions = action_pairs(rng, 3, near=True, objects=("project", "report", "dashboard"))
    b.add(
        "projects",
        "Projects",
        "hub",
        [text("Project | Owner | Tasks"), *projects] + [button(action_label(*p)) for p in actions],
    )

    actions = action_pairs(rng, 2, near=True, objects=("invoice", "account"))
    b.invoices(
        "billing",
        "Billing",
        3,
        [link("Plan", "billing/plan")] + [button(action_label(*p)) for p in actions],
    )
    plan = list(FORM_TOPICS["Plan"])
    b.form(
        "billing/plan",
        "Billing > Plan",
        rng.sample(plan, rng.randint(4, 5)),
        rng.choice(SUBMIT_LABELS),
        [rng.choice(FORM_DISTRACTORS)],
    )

    members = b.members(3)
    b.add(
        "team",
        "Team",
        "hub",
        b.member_rows("team", members)
        + [button(f"Edit {name}", f"team/{slug(name)}") for name, _, _ in members]
        + [button("Invite member")],
    )
    for name, role, _ in members:
        page = b.form(
            f"team/{slug(name)}",
            f"Team > {name}",
            list(MEMBER_FIELDS),
            "Save member",
            ["Remove member"],
        )
        page["elements"][0]["value"] = role  # the Role field shows the table's role

    topics = rng.sample(SETTINGS_TOPICS, 3)
    b.add("settings", "Settings", "menu", [link(t, f"settings/{slug(t)}") for t in topics])
    for topic in topics:
        b.form(
            f"settings/{slug(topic)}",
            f"Settings > {topic}",
            rng.sample(FORM_TOPICS[topic], rng.randint(4, 5)),
            rng.choice(SUBMIT_LABELS),
            [rng.choice(FORM_DISTRACTORS)],
        )

    docs(b, rng.sample(sorted(FACT_TOPICS), 3))


def docs(b: SiteBuilder, topics: list[str]) -> None:
    """A docs index linking to one article per topic, three facts each."""
    b.add("docs", "Docs", "menu", [link(t, f"docs/{slug(t)}") for t in topics])
    for topic in topics:
        specs = b.rng.sample(FACT_TOPICS[topic], 3)
        b.article(f"docs/{slug(topic)}", f"Docs > {topic}", specs)
