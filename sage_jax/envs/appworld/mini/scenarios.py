"""Scenario templates of the mini AppWorld.

A scenario is one reusable procedure (the skill) and three parameterised tasks. Its gold
solution is plain AppWorld code: the procedure as a top-level function, identical in the
three tasks, then one call whose arguments differ, then `complete_task`. Ground truth is
computed from the hand-written world (content.py), independently of the APIs; the builder
checks both agree by running every gold solution through AppWorld's own evaluator.
Pure Python: no appworld import.
"""

import dataclasses
import hashlib
import textwrap
from collections.abc import Callable
from typing import Any

from sage_jax.envs.appworld.mini import content

PAGE_LIMIT = 20  # the largest page the apps serve


@dataclasses.dataclass(frozen=True)
class Variant:
  """One task of a scenario: whose world it is and what it asks."""
  supervisor: content.Person
  params: dict[str, Any]  # arguments of the procedure call, and instruction fields
  answer: Any = None  # None for tasks that change state
  private_data: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Scenario:
  name: str
  split: str  # train | dev | test
  difficulty: int  # 1..3, as in AppWorld
  apps: tuple[str, ...]  # apps the solution needs (beyond supervisor)
  instruction: str  # str.format template over Variant.params
  procedure: str  # source of the reusable top-level function
  call: str  # str.format template over the repr of each param: calls it, completes task
  evaluation: str  # source of evaluation.py
  variants: Callable[[content.World], list[Variant]]

  @property
  def id(self) -> str:
    """AppWorld-style 7-hex scenario id, stable across builds."""
    return hashlib.sha1(self.name.encode()).hexdigest()[:7]

  def solution(self, variant: Variant) -> str:
    args = {k: repr(v) for k, v in variant.params.items()}
    return self.procedure.strip() + "\n\n\n" + self.call.format(**args).strip() + "\n"


def _login(*apps: str) -> str:
  """Procedure lines that log the supervisor into `apps` (`<app>_token` variables)."""
  lines = [
    'passwords = {item["account_name"]: item["password"]'
    " for item in apis.supervisor.show_account_passwords()}",
    "profile = apis.supervisor.show_profile()",
  ]
  for app in apps:
    username = 'profile["phone_number"]' if app == "phone" else 'profile["email"]'
    lines.append(f"{app}_token = apis.{app}.login(username={username}, "
                 f'password=passwords["{app}"])["access_token"]')
  return "\n".join(lines)


def _procedure(signature: str, login_apps: tuple[str, ...], body: str) -> str:
  code = _login(*login_apps) + "\n" + textwrap.dedent(body).strip()
  return f"def {signature}:\n" + textwrap.indent(code, "    ") + "\n"


def _evaluation(*blocks: str) -> str:
  body = "\n".join(textwrap.dedent(block).strip() for block in blocks)
  return ("def evaluate(test, public_data, private_data, main_user, models, "
          "ground_truth_answer):\n" + textwrap.indent(body, "    ") + "\n")


def _unchanged_test(logged_in: tuple[str, ...], changed: tuple[str, ...] = (),
                    also_ignored: tuple[str, ...] = (),
                    requirement: str = "assert no other app data changed") -> str:
  """The test that nothing changed but `changed` (collateral damage fails a task)."""
  # Logging in stamps last_logged_in on the app's User row; that is not a task change.
  ignore = [f"{app}.User" for app in logged_in] + list(also_ignored)
  return f'''
    with test("""
        {requirement}
        """):
        test.case(models.changed_model_names(ignore={ignore!r}), "==", set({sorted(changed)!r}))
    '''


def _qa_evaluation(*apps: str) -> str:
  return _evaluation('''
    with test("""
        assert the answer matches the ground truth
        """):
        test.answer(models.end.supervisor.Task.all()[0].answer, ground_truth_answer)
    ''', _unchanged_test(apps, requirement="assert no app data was changed (answering needs "
                                            "no change)"))


def _pick(world: content.World, n: int) -> content.Person:
  """The supervisor of task n (1-based): tasks of a scenario alternate supervisors."""
  return world.supervisors[(n - 1) % len(world.supervisors)]


def _all_payments(world: content.World) -> list[content.Payment]:
  return [p for h in world.holdings.values() for p in h.payments]


# --- spotify: tally library songs by genre ------------------------------------------------

def _genre_variants(world: content.World) -> list[Variant]:
  variants = []
  for n, genre in enumerate(("rock", "pop", "jazz"), 1):
    s = _pick(world, n)
    count = sum(world.song(t).genre == genre for t in world.holdings[s.email].library)
    variants.append(Variant(s, {"genre": genre}, answer=count))
  return variants


GENRE_COUNT = Scenario(
  name="spotify_library_genre_count", split="train", difficulty=1, apps=("spotify",),
  instruction="How many songs in my Spotify song library are of the {genre} genre?",
  procedure=_procedure("count_library_songs_by_genre(genre)", ("spotify",), f"""
    count = 0
    page_index = 0
    while True:
        page = apis.spotify.show_song_library(
            access_token=spotify_token, page_index=page_index, page_limit={PAGE_LIMIT})
        if not page:
            break
        for entry in page:
            if apis.spotify.show_song(song_id=entry["song_id"])["genre"] == genre:
                count += 1
        page_index += 1
    return count
    """),
  call="answer = count_library_songs_by_genre({genre})\n"
       "apis.supervisor.complete_task(answer=answer)",
  evaluation=_qa_evaluation("spotify"),
  variants=_genre_variants,
)


# --- venmo: pay someone found by name or by relationship -------------------------------------

_VENMO_PAYMENT_EVALUATION = _evaluation('''
    added, updated, removed = models.changed_records("venmo.Transaction")
    with test("""
        assert exactly one venmo transaction was added and none updated or removed
        """):
        test.case(len(added), "==", 1)
        test.case(len(updated) + len(removed), "==", 0)
    with test("""
        assert the transaction goes from the supervisor to the right person
        """):
        transaction = added[0]
        sender = models.end.venmo.User.find_one(id=transaction.sender_id)
        receiver = models.end.venmo.User.find_one(id=transaction.receiver_id)
        test.case(sender.email, "==", main_user.email)
        test.case(receiver.email, "==", private_data.receiver_email)
    with test("""
        assert the amount and description are the requested ones
        """):
        test.case(transaction.amount, "==", private_data.amount)
        test.case(transaction.description, "==", private_data.description)
    ''', _unchanged_test(("venmo", "phone"), ("venmo.Transaction",), ("venmo.Notification",)))

_SEND_BY_NAME = (("Pottery class", 45.0), ("Half of the cabin deposit", 120.0),
                 ("Thai takeout", 21.75))


def _send_by_name_variants(world: content.World) -> list[Variant]:
  variants = []
  for n, (description, amount) in enumerate(_SEND_BY_NAME, 1):
    s = _pick(world, n)
    friend = world.people[2 + 3 * n]
    variants.append(Variant(
      s, {"name": friend.name, "amount": amount, "description": description},
      private_data={"receiver_email": friend.email, "amount": amount,
                    "description": description}))
  return variants


VENMO_SEND = Scenario(
  name="venmo_send_payment_by_name", split="train", difficulty=1, apps=("venmo",),
  instruction="Send ${amount:.2f} to {name} on Venmo with the description '{description}'.",
  procedure=_procedure("send_venmo_payment(name, amount, description)", ("venmo",), f"""
    users = apis.venmo.search_users(access_token=venmo_token, query=name, page_limit={PAGE_LIMIT})
    receiver = next(u for u in users if u["first_name"] + " " + u["last_name"] == name)
    apis.venmo.create_transaction(
        receiver_email=receiver["email"], amount=amount, description=description,
        access_token=venmo_token)
    """),
  call="send_venmo_payment({name}, {amount}, {description})\napis.supervisor.complete_task()",
  evaluation=_VENMO_PAYMENT_EVALUATION,
  variants=_send_by_name_variants,
)

_SEND_BY_RELATIONSHIP = (("manager", "Team lunch", 36.5), ("landlord", "May rent top-up", 150.0),
                         ("roommate", "Internet bill", 32.4))


def _relationship_contact(world: content.World, s: content.Person, rel: str) -> content.Person:
  (email,) = [e for e, r in world.holdings[s.email].contacts if r == rel]
  return world.person(email)


def _send_by_relationship_variants(world: content.World) -> list[Variant]:
  variants = []
  for n, (relationship, description, amount) in enumerate(_SEND_BY_RELATIONSHIP, 1):
    s = _pick(world, n)
    person = _relationship_contact(world, s, relationship)
    variants.append(Variant(
      s, {"relationship": relationship, "amount": amount, "description": description},
      private_data={"receiver_email": person.email, "amount": amount,
                    "description": description}))
  return variants


VENMO_SEND_TO_CONTACT = Scenario(
  name="phone_venmo_pay_contact_by_relationship", split="test", difficulty=3,
  apps=("phone", "venmo"),
  instruction="Send ${amount:.2f} on Venmo to my {relationship} (find them in my phone "
              "contacts) with the description '{description}'.",
  procedure=_procedure(
    "pay_contact_by_relationship(relationship, amount, description)", ("phone", "venmo"), f"""
    contacts = apis.phone.search_contacts(
        access_token=phone_token, relationship=relationship, page_limit={PAGE_LIMIT})
    contact = contacts[0]
    apis.venmo.create_transaction(
        receiver_email=contact["email"], amount=amount, description=description,
        access_token=venmo_token)
    """),
  call="pay_contact_by_relationship({relationship}, {amount}, {description})\n"
       "apis.supervisor.complete_task()",
  evaluation=_VENMO_PAYMENT_EVALUATION,
  variants=_send_by_relationship_variants,
)


# --- venmo: total received from a person -----------------------------------------------------

def _received_variants(world: content.World) -> list[Variant]:
  payments = _all_payments(world)
  variants = []
  for n in (1, 2, 3):
    s = _pick(world, n)
    senders = sorted({p.sender for p in payments if p.receiver == s.email})
    sender = world.person(senders[n % len(senders)])
    total = round(sum(p.amount for p in payments
                      if p.sender == sender.email and p.receiver == s.email), 2)
    variants.append(Variant(s, {"name": sender.name}, answer=total))
  return variants


VENMO_RECEIVED = Scenario(
  name="venmo_total_received_from_person", split="dev", difficulty=2, apps=("venmo",),
  instruction="How much money in total have I received from {name} on Venmo? "
              "Answer in dollars, e.g. 12.5.",
  procedure=_procedure("total_received_from(name)", ("venmo",), f"""
    users = apis.venmo.search_users(access_token=venmo_token, query=name, page_limit={PAGE_LIMIT})
    sender = next(u for u in users if u["first_name"] + " " + u["last_name"] == name)
    total = 0.0
    page_index = 0
    while True:
        page = apis.venmo.show_transactions(
            access_token=venmo_token, user_email=sender["email"], direction="received",
            page_index=page_index, page_limit={PAGE_LIMIT})
        if not page:
            break
        total += sum(t["amount"] for t in page)
        page_index += 1
    return round(total, 2)
    """),
  call="answer = total_received_from({name})\napis.supervisor.complete_task(answer=answer)",
  evaluation=_qa_evaluation("venmo"),
  variants=_received_variants,
)


# --- simple_note: count notes with a tag ------------------------------------------------------

def _tag_variants(world: content.World) -> list[Variant]:
  variants = []
  for n, tag in enumerate(("recipes", "shopping", "work"), 1):
    s = _pick(world, n)
    count = sum(tag in tags for _, tags, _ in world.holdings[s.email].notes)
    variants.append(Variant(s, {"tag": tag}, answer=count))
  return variants


NOTE_TAG_COUNT = Scenario(
  name="simple_note_tag_count", split="train", difficulty=1, apps=("simple_note",),
  instruction="How many of my Simple Note notes are tagged '{tag}'?",
  procedure=_procedure("count_notes_with_tag(tag)", ("simple_note",), f"""
    count = 0
    page_index = 0
    while True:
        page = apis.simple_note.search_notes(
            access_token=simple_note_token, tags=[tag], page_index=page_index,
            page_limit={PAGE_LIMIT})
        if not page:
            break
        count += len(page)
        page_index += 1
    return count
    """),
  call="answer = count_notes_with_tag({tag})\napis.supervisor.complete_task(answer=answer)",
  evaluation=_qa_evaluation("simple_note"),
  variants=_tag_variants,
)


# --- simple_note: append a line to a note -----------------------------------------------------

_APPEND_LINES = ("buy more cardamom", "call the venue about parking", "return library books")


def _note_titles(world: content.World, s: content.Person) -> list[str]:
  return sorted(title for title, _, _ in world.holdings[s.email].notes)


def _append_variants(world: content.World) -> list[Variant]:
  variants = []
  for n, line in enumerate(_APPEND_LINES, 1):
    s = _pick(world, n)
    title, _, text = next(note for note in world.holdings[s.email].notes
                          if note[0] == _note_titles(world, s)[2 * n])
    variants.append(Variant(s, {"title": title, "line": line},
                            private_data={"title": title, "content": text + "\n" + line}))
  return variants


NOTE_APPEND = Scenario(
  name="simple_note_append_line", split="test", difficulty=1, apps=("simple_note",),
  instruction="Add the line '{line}' at the end of my Simple Note note titled '{title}'.",
  procedure=_procedure("append_line_to_note(title, line)", ("simple_note",), f"""
    notes = apis.simple_note.search_notes(
        access_token=simple_note_token, query=title, page_limit={PAGE_LIMIT})
    note = next(n for n in notes if n["title"] == title)
    apis.simple_note.add_content_to_note(
        note_id=note["note_id"], append_or_prepend="append", added_content=line,
        access_token=simple_note_token)
    """),
  call="append_line_to_note({title}, {line})\napis.supervisor.complete_task()",
  evaluation=_evaluation('''
    added, updated, removed = models.changed_records("simple_note.Note")
    with test("""
        assert exactly one note was updated and none added or removed
        """):
        test.case(len(updated), "==", 1)
        test.case(len(added) + len(removed), "==", 0)
    with test("""
        assert the right note now ends with the requested line
        """):
        test.case(updated[0].title, "==", private_data.title)
        test.case(updated[0].content, "==", private_data.content)
    ''', _unchanged_test(("simple_note",), ("simple_note.Note",))),
  variants=_append_variants,
)


# --- simple_note + file_system: save a note into a file ----------------------------------------

def _note_to_file_variants(world: content.World) -> list[Variant]:
  variants = []
  used = set()
  for n in (1, 2, 3):
    s = _pick(world, n)
    title = next(t for t in _note_titles(world, s)[3 * n + 1:] if t not in used)
    used.add(title)
    text = next(c for t, _, c in world.holdings[s.email].notes if t == title)
    file_name = title.lower().replace(" ", "_").replace(":", "").replace("/", "_") + ".txt"
    variants.append(Variant(
      s, {"title": title, "file_path": f"~/documents/{file_name}"},
      private_data={"path": f"/home/{s.first_name.lower()}/documents/{file_name}",
                    "content": text}))
  return variants


NOTE_TO_FILE = Scenario(
  name="simple_note_save_note_to_file", split="train", difficulty=3,
  apps=("simple_note", "file_system"),
  instruction="Save the content of my Simple Note note '{title}' into a new file "
              "{file_path} in my file system.",
  procedure=_procedure("save_note_to_file(title, file_path)", ("simple_note", "file_system"), f"""
    notes = apis.simple_note.search_notes(
        access_token=simple_note_token, query=title, page_limit={PAGE_LIMIT})
    note = next(n for n in notes if n["title"] == title)
    text = apis.simple_note.show_note(
        note_id=note["note_id"], access_token=simple_note_token)["content"]
    apis.file_system.create_file(
        file_path=file_path, content=text, access_token=file_system_token)
    """),
  call="save_note_to_file({title}, {file_path})\napis.supervisor.complete_task()",
  evaluation=_evaluation('''
    added, updated, removed = models.changed_records("file_system.File")
    with test("""
        assert exactly one file was created and none updated or removed
        """):
        test.case(len(added), "==", 1)
        test.case(len(updated) + len(removed), "==", 0)
    with test("""
        assert the file is at the requested path and holds the note's content
        """):
        test.case(added[0].path, "==", private_data.path)
        test.case(added[0].content.strip(), "==", private_data.content.strip())
    ''', _unchanged_test(("simple_note", "file_system"), ("file_system.File",),
                  ("file_system.Directory",))),
  variants=_note_to_file_variants,
)


# --- todoist: complete a project's open tasks --------------------------------------------------

def _open_titles(world: content.World, s: content.Person, project: str) -> list[str]:
  return [t.title for t in world.holdings[s.email].projects[project] if not t.completed]


def _complete_variants(world: content.World) -> list[Variant]:
  variants = []
  for n, project in enumerate(("Home renovation", "Trip to Lisbon", "Q3 planning"), 1):
    s = _pick(world, n)
    variants.append(Variant(s, {"project": project}, private_data={
      "project": project, "titles": _open_titles(world, s, project)}))
  return variants


TODO_COMPLETE = Scenario(
  name="todoist_complete_project_tasks", split="train", difficulty=2, apps=("todoist",),
  instruction="Mark every incomplete task in my Todoist project '{project}' as completed.",
  procedure=_procedure("complete_project_tasks(project_name)", ("todoist",), f"""
    project = None
    page_index = 0
    while project is None:
        page = apis.todoist.show_projects(
            access_token=todoist_token, page_index=page_index, page_limit={PAGE_LIMIT})
        if not page:
            raise ValueError("No project named " + project_name)
        project = next((p for p in page if p["name"] == project_name), None)
        page_index += 1
    listing = apis.todoist.show_tasks(
        project_id=project["project_id"], is_completed=False, access_token=todoist_token)
    tasks = list(listing["no_section_tasks"])
    for section in listing.get("sections", []):
        tasks += section["tasks"]
    for task in tasks:
        apis.todoist.update_task(
            task_id=task["task_id"], is_completed=True, access_token=todoist_token)
    """),
  call="complete_project_tasks({project})\napis.supervisor.complete_task()",
  evaluation=_evaluation('''
    added, updated, removed = models.changed_records("todoist.Task")
    with test("""
        assert no todoist task was added or removed
        """):
        test.case(len(added) + len(removed), "==", 0)
    with test("""
        assert exactly the open tasks of the project were updated
        """):
        test.case(sorted(t.title for t in updated), "==", sorted(private_data.titles))
        for task in updated:
            project = models.end.todoist.Project.find_one(id=task.project_id)
            test.case(project.name, "==", private_data.project)
    with test("""
        assert every updated task is now completed
        """):
        test.case(all(t.is_completed for t in updated), "==", True)
        test.case(len(updated), ">", 0)
    ''', _unchanged_test(("todoist",), ("todoist.Task",))),
  variants=_complete_variants,
)


# --- todoist: count open tasks of a priority across projects ---------------------------------

def _priority_variants(world: content.World) -> list[Variant]:
  variants = []
  for n, priority in enumerate(("high", "medium", "low"), 1):
    s = _pick(world, n)
    count = sum(t.priority == priority and not t.completed
                for todos in world.holdings[s.email].projects.values() for t in todos)
    variants.append(Variant(s, {"priority": priority}, answer=count))
  return variants


TODO_PRIORITY_COUNT = Scenario(
  name="todoist_open_tasks_by_priority", split="test", difficulty=2, apps=("todoist",),
  instruction="How many incomplete {priority}-priority tasks do I have across all my "
              "Todoist projects?",
  procedure=_procedure("count_open_tasks_with_priority(priority)", ("todoist",), f"""
    count = 0
    page_index = 0
    while True:
        page = apis.todoist.show_projects(
            access_token=todoist_token, page_index=page_index, page_limit={PAGE_LIMIT})
        if not page:
            break
        for project in page:
            listing = apis.todoist.show_tasks(
                project_id=project["project_id"], priority=priority, is_completed=False,
                access_token=todoist_token)
            count += len(listing["no_section_tasks"])
            count += sum(len(s["tasks"]) for s in listing.get("sections", []))
        page_index += 1
    return count
    """),
  call="answer = count_open_tasks_with_priority({priority})\n"
       "apis.supervisor.complete_task(answer=answer)",
  evaluation=_qa_evaluation("todoist"),
  variants=_priority_variants,
)


# --- phone: text a contact found by relationship ----------------------------------------------

_TEXTS = (("manager", "Running ten minutes late to the 1:1, sorry!"),
          ("landlord", "The kitchen faucet is leaking again, could you take a look?"),
          ("roommate", "Can you grab oat milk on your way home?"))


def _text_variants(world: content.World) -> list[Variant]:
  variants = []
  for n, (relationship, message) in enumerate(_TEXTS, 1):
    s = _pick(world, n)
    person = _relationship_contact(world, s, relationship)
    variants.append(Variant(s, {"relationship": relationship, "message": message},
                            private_data={"phone_number": person.phone_number,
                                          "message": message}))
  return variants


PHONE_TEXT = Scenario(
  name="phone_text_contact_by_relationship", split="train", difficulty=2, apps=("phone",),
  instruction="Text my {relationship} this message from my phone: '{message}'",
  procedure=_procedure("text_contact_by_relationship(relationship, message)", ("phone",), f"""
    contacts = apis.phone.search_contacts(
        access_token=phone_token, relationship=relationship, page_limit={PAGE_LIMIT})
    apis.phone.send_text_message(
        phone_number=contacts[0]["phone_number"], message=message, access_token=phone_token)
    """),
  call="text_contact_by_relationship({relationship}, {message})\n"
       "apis.supervisor.complete_task()",
  evaluation=_evaluation('''
    added, updated, removed = models.changed_records("phone.GlobalTextMessage")
    with test("""
        assert exactly one text message was sent
        """):
        test.case(len(added), "==", 1)
        test.case(len(updated) + len(removed), "==", 0)
    with test("""
        assert it went from the supervisor to the right contact with the right text
        """):
        sender = models.end.phone.User.find_one(id=added[0].sender_id)
        receiver = models.end.phone.User.find_one(id=added[0].receiver_id)
        test.case(sender.phone_number, "==", main_user.phone_number)
        test.case(receiver.phone_number, "==", private_data.phone_number)
        test.case(added[0].message, "==", private_data.message)
    ''', _unchanged_test(("phone",), ("phone.GlobalTextMessage",), ("phone.UserTextMessage",))),
  variants=_text_variants,
)


# --- file_system: count files of an extension under a directory -------------------------------

def _extension_variants(world: content.World) -> list[Variant]:
  variants = []
  for n, (directory, extension) in enumerate(
      (("documents", "pdf"), ("photos", "jpg"), ("downloads", "pdf")), 1):
    s = _pick(world, n)
    count = sum(name.endswith("." + extension)
                for d, entries in world.holdings[s.email].files.items()
                if d == directory or d.startswith(directory + "/") for name, _ in entries)
    variants.append(Variant(s, {"directory": f"~/{directory}/", "extension": extension},
                            answer=count))
  return variants


FILE_COUNT = Scenario(
  name="file_system_count_by_extension", split="dev", difficulty=1, apps=("file_system",),
  instruction="How many .{extension} files are in my {directory} directory, including its "
              "sub-directories?",
  procedure=_procedure("count_files_with_extension(directory, extension)", ("file_system",),
                       """
    paths = apis.file_system.show_directory(
        access_token=file_system_token, directory_path=directory, entry_type="files",
        recursive=True)
    return sum(path.endswith("." + extension) for path in paths)
    """),
  call="answer = count_files_with_extension({directory}, {extension})\n"
       "apis.supervisor.complete_task(answer=answer)",
  evaluation=_qa_evaluation("file_system"),
  variants=_extension_variants,
)


# --- spotify: build a playlist of one artist's library songs -----------------------------------

def _artist_playlist_variants(world: content.World) -> list[Variant]:
  variants = []
  for n, title in enumerate(("Best of {artist}", "{artist} Essentials", "All {artist}"), 1):
    s = _pick(world, n)
    library = world.holdings[s.email].library
    by_artist = {}
    for t in library:
      by_artist.setdefault(world.song(t).artist, []).append(t)
    artists = sorted(a for a, songs in by_artist.items() if len(songs) >= 2)
    artist = artists[n % len(artists)]
    title = title.format(artist=artist)
    variants.append(Variant(s, {"title": title, "artist": artist}, private_data={
      "title": title, "songs": sorted(by_artist[artist])}))
  return variants


ARTIST_PLAYLIST = Scenario(
  name="spotify_playlist_of_artist_library_songs", split="dev", difficulty=2,
  apps=("spotify",),
  instruction="Create a private Spotify playlist named '{title}' with all the songs by "
              "{artist} that are in my song library.",
  procedure=_procedure("make_artist_playlist(title, artist)", ("spotify",), f"""
    song_ids = []
    page_index = 0
    while True:
        page = apis.spotify.show_song_library(
            access_token=spotify_token, page_index=page_index, page_limit={PAGE_LIMIT})
        if not page:
            break
        for entry in page:
            if any(a["name"] == artist for a in entry["artists"]):
                song_ids.append(entry["song_id"])
        page_index += 1
    playlist_id = apis.spotify.create_playlist(
        title=title, is_public=False, access_token=spotify_token)["playlist_id"]
    for song_id in song_ids:
        apis.spotify.add_song_to_playlist(
            playlist_id=playlist_id, song_id=song_id, access_token=spotify_token)
    """),
  call="make_artist_playlist({title}, {artist})\napis.supervisor.complete_task()",
  evaluation=_evaluation('''
    added, updated, removed = models.changed_records("spotify.Playlist")
    with test("""
        assert exactly one playlist was created and none updated or removed
        """):
        test.case(len(added), "==", 1)
        test.case(len(updated) + len(removed), "==", 0)
    with test("""
        assert it is the supervisor's private playlist with the requested title
        """):
        owner = models.end.spotify.User.find_one(id=added[0].user_id)
        test.case(owner.email, "==", main_user.email)
        test.case(added[0].title, "==", private_data.title)
        test.case(added[0].is_public, "==", False)
    with test("""
        assert it holds exactly the artist's songs from the library
        """):
        links = models.end.spotify.PlaylistSong.find_all(playlist_id=added[0].id)
        titles = [models.end.spotify.Song.find_one(id=link.song_id).title for link in links]
        test.case(sorted(titles), "==", sorted(private_data.songs))
    ''', _unchanged_test(("spotify",), ("spotify.Playlist", "spotify.PlaylistSong"))),
  variants=_artist_playlist_variants,
)


# --- phone: count contacts of a relationship ---------------------------------------------------

def _relationship_count_variants(world: content.World) -> list[Variant]:
  variants = []
  for n, relationship in enumerate(("coworker", "friend", "sibling"), 1):
    s = _pick(world, n)
    count = sum(r == relationship for _, r in world.holdings[s.email].contacts)
    variants.append(Variant(s, {"relationship": relationship}, answer=count))
  return variants


CONTACT_COUNT = Scenario(
  name="phone_count_contacts_by_relationship", split="train", difficulty=1, apps=("phone",),
  instruction="How many of the contacts in my phone are my {relationship}s?",
  procedure=_procedure("count_contacts_with_relationship(relationship)", ("phone",), f"""
    count = 0
    page_index = 0
    while True:
        page = apis.phone.search_contacts(
            access_token=phone_token, relationship=relationship, page_index=page_index,
            page_limit={PAGE_LIMIT})
        if not page:
            break
        count += len(page)
        page_index += 1
    return count
    """),
  call="answer = count_contacts_with_relationship({relationship})\n"
       "apis.supervisor.complete_task(answer=answer)",
  evaluation=_qa_evaluation("phone"),
  variants=_relationship_count_variants,
)

SCENARIOS = (
  GENRE_COUNT, VENMO_SEND, NOTE_TAG_COUNT, TODO_COMPLETE, PHONE_TEXT, NOTE_TO_FILE,
  CONTACT_COUNT, VENMO_RECEIVED, FILE_COUNT, ARTIST_PLAYLIST, TODO_PRIORITY_COUNT,
  VENMO_SEND_TO_CONTACT, NOTE_APPEND,
)
